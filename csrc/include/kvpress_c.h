/*
 * kvpress_c: public C ABI.
 *
 * Plain C, opaque handles, plain structs and status codes, so that the library can be driven from
 * ctypes (or any FFI) without Python. Every function that can fail returns a kvc_status; on failure
 * kvc_last_error() returns a message for the calling thread. No function exits or aborts.
 */
#ifndef KVPRESS_C_H
#define KVPRESS_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KVC_API __declspec(dllexport)
#else
#define KVC_API __attribute__((visibility("default")))
#endif

#define KVC_VERSION "0.1.0"

typedef enum kvc_status {
    KVC_OK = 0,
    KVC_ERR_ARG = 1,         /* a bad argument (shape, range, null pointer) -> ValueError */
    KVC_ERR_IO = 2,          /* file missing or unreadable -> OSError */
    KVC_ERR_FORMAT = 3,      /* corrupt, truncated or inconsistent model file -> ValueError */
    KVC_ERR_NOMEM = 4,       /* allocation failed -> MemoryError */
    KVC_ERR_UNSUPPORTED = 5, /* valid but not supported (tensor type, architecture) -> NotImplementedError */
    KVC_ERR_DEVICE = 6,      /* CUDA / cuBLAS failure -> RuntimeError */
    KVC_ERR_INTERNAL = 7     /* a bug -> RuntimeError */
} kvc_status;

/* Message of the last failure on this thread ("" if none). Valid until the next failing call. */
KVC_API const char *kvc_last_error(void);
KVC_API const char *kvc_version(void);

/* ---------------------------------------------------------------------------------------------- */
/* Runtime settings                                                                                */

/* Use an external CBLAS sgemm (e.g. scipy-openblas32's libscipy_openblas.so). `symbol` is the
 * cblas_sgemm symbol name in that library ("scipy_cblas_sgemm" or "cblas_sgemm"). Pass NULL to go
 * back to the built-in blocked kernel. */
KVC_API kvc_status kvc_set_blas(const char *library_path, const char *symbol);
/* Name of the GEMM in use: "builtin" or the library path. */
KVC_API const char *kvc_blas_name(void);
/* Threads used by the CPU backend (<= 0: all cores). */
KVC_API void kvc_set_num_threads(int n);
KVC_API int kvc_get_num_threads(void);

/* ---------------------------------------------------------------------------------------------- */
/* Models                                                                                          */

/* PHI3: Phi-3 / Phi-3.5 / Phi-4-mini (fused q|k|v and gate|up tensors, partial rotary, LongRoPE).
 * GEMMA3: Gemma 3 text (norms after attention and after the MLP too, GeGLU, interleaved sliding layers).
 * QWEN3_MOE, MIXTRAL: mixture-of-experts MLPs (the config's n_experts; GGUF writes Mixtral as 'llama'). */
typedef enum kvc_arch {
    KVC_ARCH_LLAMA = 0, KVC_ARCH_MISTRAL = 1, KVC_ARCH_QWEN2 = 2, KVC_ARCH_QWEN3 = 3, KVC_ARCH_PHI3 = 4,
    KVC_ARCH_GEMMA3 = 5, KVC_ARCH_GEMMA2 = 6, KVC_ARCH_QWEN3_MOE = 7, KVC_ARCH_MIXTRAL = 8
} kvc_arch;

/* Layers whose MLP kvc_config.moe_dense can mark dense (bits of 32-bit words). */
#define KVC_MOE_DENSE_WORDS 8
#define KVC_MOE_DENSE_LAYERS (32 * KVC_MOE_DENSE_WORDS)

/* The MLP's gate activation. */
typedef enum kvc_mlp_act {
    KVC_MLP_SILU = 0,     /* SwiGLU: silu(gate) * up */
    KVC_MLP_GELU_TANH = 1 /* GeGLU (Gemma): gelu(gate) * up, GELU's tanh approximation */
} kvc_mlp_act;

/* How RoPE pairs the head dimensions. */
typedef enum kvc_rope_pairing {
    KVC_ROPE_HALF = 0,     /* (i, i + d/2): Hugging Face llama/mistral/qwen2, GGUF qwen2 ("neox") */
    KVC_ROPE_ADJACENT = 1  /* (2i, 2i + 1): GGUF llama/mistral weights (q/k rows permuted) */
} kvc_rope_pairing;

typedef struct kvc_config {
    int32_t arch;            /* kvc_arch */
    int32_t n_layers;
    int32_t hidden;          /* model dimension D */
    int32_t n_heads;         /* query heads H */
    int32_t n_kv_heads;      /* KV heads Hkv (H % Hkv == 0) */
    int32_t head_dim;        /* d */
    int32_t ffn;             /* intermediate size of the SwiGLU MLP */
    int32_t vocab;
    int32_t max_context;     /* trained context length (informational) */
    int32_t rope_pairing;    /* kvc_rope_pairing */
    int32_t tied_embeddings; /* lm_head shares the token embedding */
    int32_t qkv_bias;        /* qwen2: q/k/v projections have a bias */
    float rms_eps;
    float rope_theta;
    /* Llama-3.1 RoPE frequency scaling ("rope_type": "llama3"); factor 0 disables it. */
    float rope_scaling_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int32_t rope_original_context;
    int32_t bos_id;          /* -1 if none */
    int32_t eos_id;          /* -1 if none */
    int32_t qk_norm;         /* qwen3: RMSNorm over each head's q and k (weights [head_dim]) before RoPE */
    /* Sliding-window attention (mistral, qwen2/qwen3 with use_sliding_window): in layers
     * l >= window_first_layer, the query at position p sees the keys at positions > p - sliding_window.
     * 0: every layer attends to the whole cache. */
    int32_t sliding_window;
    int32_t window_first_layer;
    /* Partial rotary embedding (Phi-4-mini's partial_rotary_factor): RoPE turns the first rope_dim of each
     * head's head_dim values (pairs (i, i + rope_dim/2)), the rest pass through. 0: the whole head. */
    int32_t rope_dim;
    /* LongRoPE (Phi-3's "longrope"): a call whose last position + 1 exceeds rope_long_context uses the long
     * factors, else the short ones (the model holds both); 0: none. */
    int32_t rope_long_context;
    /* The factor cos and sin are multiplied by (LongRoPE's attention factor) on the rotated dimensions of
     * q and k; 0 or 1: none. */
    float rope_attn_factor;
    /* Interleaved windows (Gemma 3): with window_period P > 0, among the layers l >= window_first_layer
     * those with (l + 1) % P == 0 attend to the whole cache and the others slide. 0: every one slides. */
    int32_t window_period;
    /* RoPE base of the sliding layers (Gemma 3's rope_local_base_freq; no scaling there); 0: rope_theta. */
    float rope_local_theta;
    /* Attention's score scale (Gemma's query_pre_attn_scalar^-1/2); 0: 1/sqrt(head_dim). */
    float attn_scale;
    /* Token embeddings multiplied by it (Gemma: sqrt(hidden), rounded to the embedding's dtype); 0: none. */
    float embed_scale;
    int32_t mlp_act;         /* kvc_mlp_act */
    /* Gemma's extra norms: RMSNorm of the attention output and of the MLP output before each residual add. */
    int32_t post_norms;
    /* Logit soft-capping (Gemma 2): the scaled attention scores become attn_softcap tanh(s / attn_softcap)
     * before the softmax, the final logits logit_softcap tanh(z / logit_softcap); 0: none. */
    float attn_softcap;
    float logit_softcap;
    /* Mixture of experts (0 experts: every MLP is dense). In an MoE layer the MLP is n_experts SwiGLU experts of
     * intermediate size moe_ffn and a router (a [n_experts, hidden] matrix): each token's router logits go through
     * a softmax, its n_experts_used most probable experts run on it and their outputs are summed weighted by
     * those probabilities, renormalised to sum 1 over the chosen when moe_norm_topk (Qwen3-MoE's norm_topk_prob;
     * Mixtral always). Layer l is an MoE layer when (l + 1) % moe_step == 0 and bit l of moe_dense is clear
     * (Qwen3-MoE's decoder_sparse_step and mlp_only_layers); the others are dense MLPs of intermediate size ffn. */
    int32_t n_experts;
    int32_t n_experts_used;
    int32_t moe_ffn;
    int32_t moe_norm_topk;
    int32_t moe_step;
    uint32_t moe_dense[KVC_MOE_DENSE_WORDS]; /* bit l % 32 of word l / 32: layer l is dense */
} kvc_config;

typedef struct kvc_model kvc_model;

/* Load a GGUF file or a Hugging Face folder (config.json + *.safetensors) onto the CPU. Files are
 * memory-mapped (read-only, private); weight matrices stay in the file's type (F16, BF16, Q4_0 ... Q8_0,
 * the K-quants: KVC_WEIGHTS_NATIVE) and are used in place in the mapping where their layout allows (the
 * file stays mapped as long as the model), see kvc_model_load_ex. (kvc_model_load_device: other devices.) */
KVC_API kvc_status kvc_model_load(const char *path, kvc_model **out);
/* How weight matrices are held: NATIVE in the file's type where the device's kernels take it (the
 * CPU: every type the loader reads; other devices convert to their own), FP32 converted to fp32 (the
 * reference mode, and what kvc_model_load did before native weights). */
enum { KVC_WEIGHTS_NATIVE = 0, KVC_WEIGHTS_FP32 = 1 };
/* Or'ed into NATIVE: copy every weight into memory instead of using it in place in the mapped file
 * (llama.cpp's --no-mmap; the file is then closed once loaded). */
#define KVC_WEIGHTS_NO_MMAP 0x100
/* Or'ed into NATIVE: keep every weight in the file's layout, so the types the CPU backend would rearrange
 * for its decode GEMV (Q4_0, Q4_1, Q8_0: 16 rows interleaved) are used in place in the mapped file too:
 * the least anonymous memory, the slower row-by-row decode kernels. */
#define KVC_WEIGHTS_NO_REPACK 0x200
KVC_API kvc_status kvc_model_load_ex(const char *path, int32_t device, int32_t weights, kvc_model **out);
/* KVC_WEIGHTS_NATIVE or KVC_WEIGHTS_FP32 as loaded, and how many weight tensors of the file are held in
 * their file's type. */
KVC_API int32_t kvc_model_weights(const kvc_model *model, int32_t *n_native);
KVC_API void kvc_model_free(kvc_model *model);
KVC_API kvc_status kvc_model_get_config(const kvc_model *model, kvc_config *out);
/* 1 when layer `layer`'s MLP is a mixture of experts (kvc_config's n_experts, moe_step, moe_dense), else 0. */
KVC_API int32_t kvc_model_layer_moe(const kvc_model *model, int32_t layer);
/* Bytes of weights held by the model (those mapped from its file included). */
KVC_API size_t kvc_model_weight_bytes(const kvc_model *model);
/* Of those, bytes used in place in the model file, memory-mapped read-only (shared page cache: RSS counts
 * them as file pages, not anonymous memory). */
KVC_API size_t kvc_model_mapped_bytes(const kvc_model *model);
/* "gguf" or "safetensors". */
KVC_API const char *kvc_model_format(const kvc_model *model);

/* GGUF metadata (empty for Hugging Face folders). Values are exposed as typed arrays: a scalar is an
 * array of one element. Types follow GGUF: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool,
 * 8 string, 10 u64, 11 i64, 12 f64. */
KVC_API int64_t kvc_model_meta_count(const kvc_model *model);
KVC_API kvc_status kvc_model_meta_info(const kvc_model *model, int64_t i, const char **key,
                                       int32_t *type, int32_t *is_array, uint64_t *n);
/* Numeric element j as double (for bool/ints/floats). */
KVC_API kvc_status kvc_model_meta_number(const kvc_model *model, int64_t i, uint64_t j, double *out);
/* String element j (not NUL-terminated). */
KVC_API kvc_status kvc_model_meta_string(const kvc_model *model, int64_t i, uint64_t j,
                                         const char **s, uint64_t *len);

/* ---------------------------------------------------------------------------------------------- */
/* Sessions: one sequence, its KV cache and scratch.                                               */

typedef struct kvc_session kvc_session;

/* The K/V cache's storage type (docs/METHODS.md, "Quantised K/V cache"): what each kept row costs.
 * KVC_KV_NATIVE: the device's own (f32 on the CPU, bf16 on devices). kivi4 / kivi2: KIVI's asymmetric
 * codes, keys per channel over `group` rows, values per row over min(group, head_dim) channels, the most
 * recent rows in f32 until `residual` of them wait (transformers' QuantizedCache: nbits, q_group_size,
 * residual_length). group and residual are ignored by the other types. */
enum { KVC_KV_NATIVE = -1, KVC_KV_F32 = 0, KVC_KV_BF16 = 1, KVC_KV_F16 = 2, KVC_KV_Q8_0 = 3, KVC_KV_KIVI4 = 4,
       KVC_KV_KIVI2 = 5, KVC_KV_N_TYPES = 6 };
typedef struct kvc_kv_format {
    int32_t type;
    int32_t group;    /* KIVI: rows of a key block and channels of a value group (q_group_size) */
    int32_t residual; /* KIVI: rows that wait in f32 before they are quantised (residual_length) */
} kvc_kv_format;
/* The type new sessions of this model get (KVC_KV_NATIVE at load). KVC_ERR_ARG for a format the model's
 * heads cannot take (a group that does not divide head_dim, ...), with what to change. */
KVC_API kvc_status kvc_model_set_kv_format(kvc_model *model, const kvc_kv_format *format);
KVC_API void kvc_model_get_kv_format(const kvc_model *model, kvc_kv_format *out);
/* A session's own type; only while its cache is empty (fresh or reset): KVC_ERR_ARG otherwise. */
KVC_API kvc_status kvc_session_set_kv_format(kvc_session *s, const kvc_kv_format *format);
/* The session's type as its stores hold it (KVC_KV_NATIVE resolved to the device's type). */
KVC_API void kvc_session_get_kv_format(const kvc_session *s, kvc_kv_format *out);

/* `capacity_hint`: tokens to preallocate per KV head (0: grow as needed). */
KVC_API kvc_status kvc_session_new(kvc_model *model, int64_t capacity_hint, kvc_session **out);
KVC_API void kvc_session_free(kvc_session *s);
/* Forget everything (cache emptied, position 0). */
KVC_API void kvc_session_reset(kvc_session *s);

typedef enum kvc_logits_mode { KVC_LOGITS_NONE = 0, KVC_LOGITS_LAST = 1, KVC_LOGITS_ALL = 2 } kvc_logits_mode;

/* Run `n` tokens through the model, appending their K/V to the cache (prefill when n > 1, a decode
 * step when n == 1). Logits go to `logits` ([1, vocab] for LAST, [n, vocab] for ALL). */
KVC_API kvc_status kvc_forward(kvc_session *s, const int32_t *ids, int64_t n, int32_t logits_mode,
                               float *logits);

/* The general form: n_ids token ids followed by n_emb rows of input embeddings [n_emb, hidden]
 * (soft tokens), positions continuing from the session's. logits_row: KVC_ROW_NONE, KVC_ROW_ALL
 * ([n, vocab]) or the index of one row ([vocab]). */
#define KVC_ROW_NONE (-1)
#define KVC_ROW_ALL (-2)
KVC_API kvc_status kvc_forward_ex(kvc_session *s, const int32_t *ids, int64_t n_ids, const float *embeddings,
                                  int64_t n_emb, int64_t logits_row, float *logits);
/* One prefill, many caches: `s` computes the forward of `ids` once; each follower session receives
 * every layer's new K/V rows and runs its own attached press on them, exactly as if it had run the
 * prefill itself (a press acts after a layer's attention, so it never changes the hidden states).
 * The leader and all followers must be empty (fresh or reset) sessions of the same model; on
 * failure the followers are reset. Presses that change the forward (TAKE, Judge Q) cannot follow. */
KVC_API kvc_status kvc_forward_shared(kvc_session *s, kvc_session *const *followers, int32_t n_followers,
                                      const int32_t *ids, int64_t n, int64_t logits_row, float *logits);
/* Batched decode: one token ids[i] for each of B sessions of the same model (any caches, any
 * positions, no press attached), logits [B, vocab]. The weight GEMMs run once for all B rows. */
KVC_API kvc_status kvc_forward_batch(kvc_session *const *sessions, int32_t B, const int32_t *ids, float *logits);
/* Set the position the next token gets (e.g. after dropping appended soft or probe tokens). */
KVC_API kvc_status kvc_session_set_position(kvc_session *s, int64_t position);

/* Next position a new token gets (tokens seen so far, evicted ones included). */
KVC_API int64_t kvc_session_position(const kvc_session *s);
/* Tokens held in the cache of (layer, kv_head). */
KVC_API int64_t kvc_session_cache_len(const kvc_session *s, int32_t layer, int32_t kv_head);
/* Bytes the KV cache holds now (allocated capacity) and at most so far. */
KVC_API size_t kvc_session_cache_bytes(const kvc_session *s);
KVC_API size_t kvc_session_peak_cache_bytes(const kvc_session *s);
/* Wall seconds spent in the attached press (scoring, selection, compaction) since the last reset,
 * including the press of this session as a follower of a shared forward. */
KVC_API double kvc_session_press_seconds(const kvc_session *s);

/* Cut the cache back to new_len[layer * Hkv + h] rows per head (<= current) and set the next
 * position: used to return to a compressed context between questions. */
KVC_API kvc_status kvc_session_truncate(kvc_session *s, const int64_t *new_len, int64_t position);
/* Make the empty session dst (same model, same device) hold an exact copy of src's cache and
 * position, e.g. to compress one prefill several ways. The press attached to dst stays; on failure
 * dst stays empty. */
KVC_API kvc_status kvc_session_copy_cache(kvc_session *dst, const kvc_session *src);
/* Original positions of the rows of (layer, kv_head): out must hold kvc_session_cache_len() values. */
KVC_API kvc_status kvc_session_cache_positions(const kvc_session *s, int32_t layer, int32_t kv_head, int64_t *out);
/* The cached K and V rows of (layer, kv_head) as fp32: k, v (either may be NULL) hold kvc_session_cache_len() x
 * head_dim values each. */
KVC_API kvc_status kvc_session_cache_rows(const kvc_session *s, int32_t layer, int32_t kv_head, float *k, float *v);

/* What a prefill press sees of a layer in a call on a session that holds rows already: every row
 * (KVC_PRESS_SCOPE_CACHE, the default: the whole cache is compressed again), or only this call's rows
 * (KVC_PRESS_SCOPE_CALL: the rows held before are set aside while the press runs, as after a prefill into an
 * empty session, and kept as they were; a conversation's turns). TAKE's chunked prefill (kvc_session_prefill_take)
 * follows it too, its call's rows being those of all its chunks. */
enum { KVC_PRESS_SCOPE_CACHE = 0, KVC_PRESS_SCOPE_CALL = 1 };
KVC_API kvc_status kvc_session_set_press_scope(kvc_session *s, int32_t scope);
KVC_API int32_t kvc_session_press_scope(const kvc_session *s);

/* Saved caches (csrc/persist/; docs/ARCHITECTURE.md "Saved caches"): a session's cache written exactly to a
 * safetensors file (per layer and KV head its rows, positions, K/V in the store's type, ThinK's freed key
 * channels), with its position, the attached presses' state between calls (a decoding press's counters,
 * buffered queries and score queues: a cache saved mid-answer goes on as the session that saved it), the model's
 * identity (configuration and a SHA-256 of its weight files) and a SHA-256 of the whole file; n_meta string
 * pairs keys[i] -> values[i] of the caller's ride along (keys must not start with "kvc."). Format version
 * KVC_CACHE_FILE_VERSION (3: the K/V storage type; 2: the presses' state); an older or newer file is refused. */
#define KVC_CACHE_FILE_VERSION 3
KVC_API kvc_status kvc_session_save(kvc_session *s, const char *path, int32_t n_meta, const char *const *keys,
                                    const char *const *values);
/* Fill the empty session s (fresh or reset) from a saved cache: KVC_ERR_FORMAT, saying which, for a file of
 * another model, an older or newer format version, a truncated or corrupt file. The presses attached to s stay
 * and receive the state the file holds for them (a press attached at the save and attached again here, with the
 * same settings: every value is checked against its settings and the cache; KVC_ERR_FORMAT and s left empty,
 * its presses reset, otherwise); a press the file holds no state for starts afresh. */
KVC_API kvc_status kvc_session_load(kvc_session *s, const char *path);
/* The same with the rows stored in the type *as (a saved f32 cache loaded as q8_0, KIVI, ...: each row encoded
 * as an append encodes it), or the file's type where as is NULL. */
KVC_API kvc_status kvc_session_load_as(kvc_session *s, const char *path, const kvc_kv_format *as);
/* A saved cache's metadata (checked as kvc_session_load checks the file) as a JSON object of strings into
 * out[cap]; *needed receives the bytes it takes (NUL included): call again with a larger out if cap < *needed. */
KVC_API kvc_status kvc_cache_file_metadata(const char *path, char *out, size_t cap, size_t *needed);
/* "sha256:<64 hex>" of the model's weight files (GGUF file, or a folder's *.safetensors by name) into out
 * (cap >= 72): the identity a saved cache records. Computed once per model. */
KVC_API kvc_status kvc_model_digest(kvc_model *model, char *out, size_t cap);

/* ---------------------------------------------------------------------------------------------- */
/* Presses: what to keep when a prefill compresses the cache (see docs/METHODS.md).                     */

/* Presses are made and set by name (kvc_press_spec below): a press's settings never cross the ABI as a
 * struct. The scorers, allocations and safeguards are names too ("snapkv", "pyramid", "protect": the choices of
 * kvc_press_param_info's "scorer", "allocation" and "safeguard"). */

/* ---- A scorer the caller gives: a C function the engine calls for every layer it compresses ----
 * With scorer "callback" (its scores ranked by the press's allocation), "callback_window" (the same, the last
 * `window` rows of every head protected, as SnapKV's), "callback_stats" (the same, a decoding press buffering every
 * row's query for it: statistics of all queries, as ExpectedAttention's) or "callback_select" (it chooses the kept
 * rows itself: keep, n_keep), the engine calls `callback` once per layer, at every compression (prefill, TAKE's chunks, a decoding
 * press's intervals), on the calling thread. Everything in the view is valid during the call only (longer for what
 * kvc_scorer_view_retain keeps); arrays are host fp32, row-major, with the sizes beside them, except the rows lent in
 * place (KVC_VIEW_IN_PLACE). The callback returns 0, or nonzero to fail the forward (the
 * call is rolled back; message, if it wrote one, is the error's text). */
enum {
    KVC_VIEW_VALUES = 1 << 0,     /* values */
    KVC_VIEW_QUERIES = 1 << 1,    /* the window queries after RoPE */
    KVC_VIEW_HIDDEN = 1 << 2,     /* the layer's normed input rows of this call */
    KVC_VIEW_ATTENTIONS = 1 << 3, /* the window queries' attention over every row (softmax, causal) */
    KVC_VIEW_ALL_QUERIES = 1 << 4, /* the window is every query of the call (ExpectedAttention's statistics), not
                                    * the config's window (which TAKE sets to its probes) */
    KVC_VIEW_IN_PLACE = 1 << 5,   /* each head's rows where the K/V store keeps them (key_rows, value_rows), no copy */
};
/* The element type of rows lent in place (kvc_scorer_view.rows_dtype). */
enum { KVC_ROWS_F32 = 0, KVC_ROWS_BF16 = 1 };
typedef struct kvc_scorer_view {
    int32_t layer, n_layers;       /* the layer scored, of how many */
    int32_t n_heads, n_kv_heads, head_dim, hidden_dim;
    int32_t device;                /* the session's kvc_device */
    const int64_t *len;            /* [n_kv_heads] rows each head holds (heads may differ: Ada-KV, decoding) */
    int64_t max_len;               /* the row stride of keys, values, attentions, scores and keep */
    const float *keys;             /* [n_kv_heads, max_len, head_dim]; rows past len[h] are zeros */
    const float *values;           /* the same (KVC_VIEW_VALUES), else NULL */
    int64_t n_call;                /* rows this forward call appended (the last n_call rows of a prefill's heads) */
    const int64_t *positions;      /* [n_call] their positions */
    int32_t window;                /* w: the call's last queries the scorer reads (the config's window, >= 1 if asked) */
    const float *queries;          /* [w, n_heads, head_dim] after RoPE (KVC_VIEW_QUERIES), else NULL */
    const float *hidden;           /* [n_call, hidden_dim] (KVC_VIEW_HIDDEN), else NULL */
    const float *attentions;       /* [n_heads, w, max_len]: window query i sees head rows < len - w + i + 1 (zeros
                                    * after) (KVC_VIEW_ATTENTIONS), else NULL */
    float *scores;                 /* out [n_kv_heads, max_len]: higher keeps (finite); "callback" and "callback_window" */
    int64_t *keep;                 /* out [n_kv_heads, max_len]: kept row indices ("callback_select") */
    int64_t *n_keep;               /* out [n_kv_heads]: how many */
    char *message;                 /* a failing callback may say why here (message_size bytes) */
    int32_t message_size;
    int32_t rope_pairing;          /* the model's kvc_rope_pairing of the keys' and queries' channels */
    const double *rope_freq;       /* [head_dim / 2] RoPE's frequency of each pair (scaling applied) */
    int64_t future_from;           /* the first position after the rows the queries came from (a decoding press's
                                    * buffer: kvpress's q_len, as ExpectedAttention's future positions start) */
    double rope_attn_factor;       /* what RoPE multiplied the turned pairs by (LongRoPE's attention factor; else 1):
                                    * rope_freq and this are the call's RoPE, as the forward turned its rows */
    /* KVC_VIEW_IN_PLACE, where the store keeps its rows plainly (no ThinK-pruned rows; f32 or bf16), else NULL:
     * key_rows[h] and value_rows[h] (KVC_VIEW_VALUES) at row 0 of head h, len[h] rows of head_dim elements, row-major,
     * of rows_dtype, in host memory when rows_host, else in the device's (CUDA; the device's work on them is
     * complete). f32 rows in host memory (the CPU) are the view: keys and values are then NULL; otherwise keys and
     * values are the host copies as without the flag. */
    const void *const *key_rows;
    const void *const *value_rows;
    int32_t rows_dtype;            /* KVC_ROWS_F32 or KVC_ROWS_BF16 */
    int32_t rows_host;
    void *engine;                  /* the engine's (kvc_scorer_view_retain) */
} kvc_scorer_view;
typedef int32_t (*kvc_scorer_callback)(void *user, const kvc_scorer_view *view);
/* For a callback whose arrays must outlive its call (a Python press that kept one): called during the call, it keeps
 * the memory of keys, values, the rows lent in place, queries, hidden, attentions and positions valid until
 * kvc_scorer_view_release(handle), on any thread; the store then continues in a copy of the rows it lent. NULL on
 * failure (kvc_last_error). The pointer tables (len, key_rows, value_rows), rope_freq, scores, keep and message stay
 * the call's. */
KVC_API void *kvc_scorer_view_retain(const kvc_scorer_view *view);
KVC_API void kvc_scorer_view_release(void *handle);

/* ---- Presses by name: the interface for bindings and C clients (no struct to mirror, no codes) ---- */
/* A press's settings, opaque: made from a scorer's name ("snapkv", "knorm", ...: kvc_press_param_info of
 * "scorer" lists them) with kvpress's defaults, then set by name. Every setting is a row of one table
 * (csrc/press/params.c); kvc_press_spec_check is the one validation. */
typedef struct kvc_press_spec kvc_press_spec;
KVC_API kvc_status kvc_press_spec_new(const char *scorer, kvc_press_spec **out);
KVC_API void kvc_press_spec_free(kvc_press_spec *p);
/* Set a setting by name: integers and flags (set_i64; seed also set_u64), numbers (set_f64: an integer
 * setting takes an integral value), names of a choice (set_str: scorer, allocation, safeguard). An unknown
 * name or a value its type cannot hold: KVC_ERR_ARG naming it. */
KVC_API kvc_status kvc_press_spec_set_i64(kvc_press_spec *p, const char *name, int64_t value);
KVC_API kvc_status kvc_press_spec_set_u64(kvc_press_spec *p, const char *name, uint64_t value);
KVC_API kvc_status kvc_press_spec_set_f64(kvc_press_spec *p, const char *name, double value);
KVC_API kvc_status kvc_press_spec_set_str(kvc_press_spec *p, const char *name, const char *value);
/* A setting's value as a double (a choice: its index in the choices of kvc_press_param_info). */
KVC_API kvc_status kvc_press_spec_get(const kvc_press_spec *p, const char *name, double *value);
KVC_API kvc_status kvc_press_spec_check(const kvc_press_spec *p);
/* Tokens a head of n rows keeps at `layer` (kvc_press_kept's rule). */
KVC_API kvc_status kvc_press_spec_kept(const kvc_press_spec *p, int32_t layer, int32_t n_layers, int64_t n, int64_t *out);
/* Attach (NULL detaches) / chain after the attached press (ComposedPress). The spec is copied: free it after. */
KVC_API kvc_status kvc_session_attach_press(kvc_session *s, const kvc_press_spec *p);
KVC_API kvc_status kvc_session_chain_press(kvc_session *s, const kvc_press_spec *p);
/* The press on arrays (kvc_device_press_compute), every array with its size in values: q and attn (NULL: none)
 * [n, H, d], k and v [Hkv, len, d] (n_kv_values each), scores and keep [Hkv, len]; n_keep [Hkv]. */
KVC_API kvc_status kvc_press_spec_compute(int32_t device, const kvc_press_spec *p, int32_t H, int32_t Hkv, int32_t d,
                                          int32_t layer, int32_t n_layers, const float *q, int64_t n_q, const float *attn,
                                          int64_t n_attn, int64_t n, const float *k, const float *v, int64_t n_kv_values,
                                          int64_t len, int64_t layer_total, float *scores, int64_t n_scores, int64_t *keep,
                                          int64_t n_keep_rows, int64_t *n_keep);
typedef struct kvc_decoding_config kvc_decoding_config; /* below */
/* A decoding press's settings by name: its own, then its base press's (kvc_decoding_config_new). */
KVC_API kvc_status kvc_decoding_config_set_i64(kvc_decoding_config *c, const char *name, int64_t value);
KVC_API kvc_status kvc_decoding_config_set_u64(kvc_decoding_config *c, const char *name, uint64_t value);
KVC_API kvc_status kvc_decoding_config_set_f64(kvc_decoding_config *c, const char *name, double value);
KVC_API kvc_status kvc_decoding_config_set_str(kvc_decoding_config *c, const char *name, const char *value);
/* Whether `name` is a setting of a press (kvc_press_param_index >= 0) or of a decoding press. */
KVC_API int32_t kvc_press_param_index(const char *name);
KVC_API int32_t kvc_decoding_param_known(const char *name);
/* Introspection: the settings, their types ("int", "uint", "float", "bool", "choice"), defaults and the range
 * the check accepts (documentation: kvc_press_spec_check is the rule). */
typedef struct kvc_param_info {
    const char *name;
    const char *type;
    const char *doc;
    double default_value;        /* a choice: the index of default_choice */
    double lo, hi;
    int32_t n_choices;           /* a choice: its names */
    const char *const *choices;
    const char *default_choice;
} kvc_param_info;
KVC_API int32_t kvc_press_param_count(void);
KVC_API kvc_status kvc_press_param_info(int32_t i, kvc_param_info *out);

/* The scorer table (csrc/press/scorer.h), for introspection: how many scorers, and the i-th (0 <= i <
 * kvc_scorer_count()): its `scorer` name, its index (i: what a config's `scorer` holds), trait bits and the
 * NULL-terminated names of the settings it reads (any output may be NULL). Strings are static. */
KVC_API int32_t kvc_scorer_count(void);
KVC_API kvc_status kvc_scorer_info(int32_t i, const char **name, int32_t *code, uint32_t *traits,
                                   const char *const **params);
/* TADA's layer capacities: integer budgets proportional to weights[L] (negative or non-finite count as 0),
 * each in [lo, hi], summing to total clamped to [L lo, L hi] (bisection on the scale, then largest
 * remainders). */
KVC_API kvc_status kvc_tada_allocate(const double *weights, int32_t L, int64_t total, int64_t lo, int64_t hi, int64_t *out);
/* Scores of the last compression at `layer` for `kv_head` (over that head's rows before eviction):
 * *n receives the count; out (may be NULL to query n) receives them. Needs record_scores. */
KVC_API kvc_status kvc_session_press_scores(const kvc_session *s, int32_t layer, int32_t kv_head, float *out, int64_t *n);
/* Ada-KV's eviction loss at `layer`: mean over window queries and heads of the L1 distance between
 * the attention output with the full and with the kept cache (needs record_scores and a window). */
KVC_API kvc_status kvc_session_press_error(const kvc_session *s, int32_t layer, double *out);

/* KVC_ALLOC_LAYER: total tokens kept at each layer, summed over its KV heads (n_layers values). */
KVC_API kvc_status kvc_session_set_layer_budgets(kvc_session *s, const int64_t *totals, int32_t n_layers);
/* TADA statistics of the last compression at `layer`: E_internal (sum of the scores over heads and
 * past rows) and the cosine dissimilarity 1 - cos(R, R + O) averaged over the window tokens. */
KVC_API kvc_status kvc_session_press_layer_stats(const kvc_session *s, int32_t layer, double *e_internal,
                                                 double *dissimilarity);

/* Value merging on eviction as functions on arrays (csrc/press/merge.c; sessions run the same code on the rows
 * their backend gives the host). MergingPress, one KV head: k, v [n, d], keep [n_keep] its kept rows
 * (increasing); v_out [n_keep, d] receives the kept rows' values after every evicted row is folded into its most
 * key-similar kept row (similarity_threshold, merge_fraction as kvpress). */
KVC_API kvc_status kvc_merge_similar(const float *k, const float *v, int64_t n, int32_t d, const int64_t *keep,
                                     int64_t n_keep, float threshold, float fraction, float *v_out);
/* CAMPress's selection and merge for one layer whose Hkv heads hold the same n rows: scores [Hkv, n] (the base
 * press's), attn [Hkv, n] (cumulative attention), v [Hkv, n, d]. keep [target] receives the top `target` rows of
 * the scores' mean over heads (increasing), v_out [Hkv, target, d] their values after the best-scored n_merge
 * evicted rows are merged into the next merge_budget kept rows; (seed, layer, event) pick the Bernoulli draws. */
KVC_API kvc_status kvc_cam_merge(const float *scores, const float *attn, const float *v, int32_t Hkv, int64_t n,
                                 int32_t d, int64_t target, int64_t n_merge, int32_t merge_budget, uint64_t seed,
                                 int32_t layer, int64_t event, int64_t *keep, float *v_out);

/* ---------------------------------------------------------------------------------------------- */
/* Wrapper presses (kvpress ComposedPress, PerLayerCompressionPress)                                */

/* ComposedPress: kvc_session_chain_press (after the attached press compresses a layer, the chained press
 * compresses what it kept, and so on down the chain; ObservedAttention cannot follow). */
/* Presses' arrays by name (PerLayerCompressionPress's "layer_ratios", DuoAttention's "head_budgets", BlockPress's
 * "block_size", KeyRerotationPress's "key_rerotation", ThinK's "key_channel_ratio" / "channel_window" /
 * "channel_free", QFilterPress's "key_filters", ExpectedAttentionStatsPress's "query_mean" / "query_cov", LU-KV's
 * "head_prune" / "lukv_sink" / "lukv_window"): set on the last press of the chain, n values of `type`, checked
 * against the array's row (its type, and its count from the model: kvc_press_array_info); a wrapper that cannot
 * act on that press says why (KVC_ERR_ARG). What each array means: its doc, and docs/METHODS.md. */
enum { KVC_ARRAY_F32 = 0, KVC_ARRAY_F64 = 1, KVC_ARRAY_I64 = 2 };
KVC_API kvc_status kvc_session_set_press_array(kvc_session *s, const char *name, int32_t type, const void *data, int64_t n);
typedef struct kvc_press_array_desc {
    const char *name;
    const char *press; /* the press it belongs to ("BlockPress", ...) */
    int32_t type;      /* KVC_ARRAY_* */
    const char *shape; /* its count: "one", "layers", "layers x kv_heads", ... */
    const char *doc;
} kvc_press_array_desc;
KVC_API int32_t kvc_press_array_count(void);
KVC_API kvc_status kvc_press_array_info(int32_t i, kvc_press_array_desc *out);
/* KVzapPress: the press scores the rows of a prefill (into an empty session) with a per-layer model of the
 * attention block's normed input x [n, D]: hidden_dim 0: s = x W1^T + b1 (W1 [L, Hkv, D], b1 [L, Hkv]);
 * else s = GELU(x W1^T + b1) W2^T + b2 (W1 [L, hidden_dim, D], b1 [L, hidden_dim], W2 [L, Hkv, hidden_dim],
 * b2 [L, Hkv]; exact erf GELU). Scores are computed on the host, in float64 accumulation. */
KVC_API kvc_status kvc_session_set_kvzap(kvc_session *s, int32_t hidden_dim, const float *w1, const float *b1,
                                         const float *w2, const float *b2);
/* The same for the session's decoding press (its base an ExpectedAttention press): the given statistics instead of
 * the buffered queries'. */
KVC_API kvc_status kvc_session_set_decoding_query_stats(kvc_session *s, const float *mean, const float *cov,
                                                        int64_t n_mean, int64_t n_cov);
/* FastKVzipPress (arXiv 2601.17668): per layer a gate of the attention block's normed input x [n, D] scores each
 * row for each KV head h: q = RMSNorm(x Wq^T + bq) per group g, k = RMSNorm(x Wk^T) (per-head norms over
 * out_dim, weights q_norm, k_norm, eps norm_eps), logit_g = k.q_g / sqrt(out_dim) + b[h, g],
 * base_{s,g} = k_base[h, s].q_g / sqrt(out_dim), score = mean_g 1 / (1 + sum_s exp(base_{s,g} - logit_g)). The
 * first n_sink rows and a window of the last rows (max(1, int(n window_ratio)) below 32000 rows, else
 * window_size) score 1; after the last layer, the int(L Hkv n ratio) lowest over all layers and heads go (or
 * int(Hkv n ratio) per layer with layerwise). A prefill into an empty session; the ratio is the press's. */
typedef struct kvc_fastkvzip_config {
    int32_t n_groups;   /* gate queries per KV head (the file's ngroup) */
    int32_t out_dim;    /* the gate's head dim (16) */
    int32_t n_base;     /* k_base rows per head (the file's sink) */
    const float *wq;    /* [L, Hkv * n_groups * out_dim, D] q_proj weight */
    const float *bq;    /* [L, Hkv * n_groups * out_dim] q_proj bias */
    const float *wk;    /* [L, Hkv * out_dim, D] k_proj weight */
    const float *q_norm, *k_norm; /* [L, out_dim] RMSNorm weights */
    const float *k_base; /* [L, Hkv, n_base, out_dim] */
    const float *b;     /* [L, Hkv, n_groups] */
    float norm_eps;     /* 1e-6 (Qwen3RMSNorm's default) */
    int32_t n_sink;     /* 4 */
    int64_t window_size;/* 4096: the window from 32000 rows on */
    double window_ratio;/* 0.02: the window's share of shorter prompts */
    int32_t layerwise;  /* 0: one global ranking over the layers */
} kvc_fastkvzip_config;
KVC_API kvc_status kvc_session_set_fastkvzip(kvc_session *s, const kvc_fastkvzip_config *cfg);
/* Pre-RoPE query moments of a prompt, the producer of ExpectedAttentionStats: runs `ids` through the model on
 * the (empty) session and adds, per layer and query head, the queries i >= n_sink with RoPE undone (after any
 * q norm; this model's channel order) to sum [L, H, d] and their products to outer [L, H, d, d] (both filled
 * in, summed across calls); the session is reset afterwards. */
KVC_API kvc_status kvc_session_query_moments(kvc_session *s, const int32_t *ids, int64_t n, int32_t n_sink, double *sum,
                                             int64_t n_sum, double *outer, int64_t n_outer);
/* (The setters of this block apply to the last press of the chain: ComposedPress adds a member, then sets it.) */

/* DMSPress (kvpress; csrc/press/dms.c) is a press with the setting dms = 1: attached (kvc_session_attach_press) it
 * acts on a prefill into an empty session; as the base of a decoding press (kvc_session_set_decoding_press,
 * its setting dms = 1) on every later call, continuing the prefill's window (kvpress DMSPress(decoding=True)). */

/* ---------------------------------------------------------------------------------------------- */
/* Compression while decoding (kvpress DecodingPress, CompressionRatioDecodingPress).                  */
/* A decoding press rides on every forward call of a session after its first (the prefill): each call */
/* is one kvpress "decoding step" (a single token, or a question of several). Every                   */
/* compression_interval steps each layer is compressed, right after its attention, to target_size rows */
/* per KV head with the base press's scorer and allocation, evicted for real (the ragged cache is     */
/* re-packed with room for compression_interval more rows). Window scorers read the queries of the    */
/* last steps (the buffered hidden states of kvpress, kept here as post-RoPE queries).                 */

/* A decoding press's settings (opaque): made with kvpress's defaults, set by name (kvc_decoding_config_set_*:
 * compression_interval, target_size, ratio_target, target_compression_ratio, hidden_states_buffer_size,
 * cam_merge_budget, cam_seed, then any setting of its base press: scorer, allocation, ...). */
KVC_API kvc_status kvc_decoding_config_new(kvc_decoding_config **out);
KVC_API void kvc_decoding_config_free(kvc_decoding_config *cfg);

KVC_API kvc_status kvc_decoding_config_check(const kvc_decoding_config *cfg);
/* Attach (NULL detaches) the decoding press; it works beside a prefill press (kvc_session_attach_press:
 * kvpress PrefillDecodingPress) and survives kvc_session_reset with its counters cleared. */
KVC_API kvc_status kvc_session_set_decoding_press(kvc_session *s, const kvc_decoding_config *cfg);
/* Layer compressions the decoding press made since it was attached or the session reset. */
KVC_API int64_t kvc_session_decoding_compressions(const kvc_session *s);

/* Whole-cache methods (KVzip, KVgrad, KVCompose, the query moments): every array with its size in values, which
 * must be the size the comment gives (KVC_ERR_ARG naming it otherwise). */
/* ---------------------------------------------------------------------------------------------- */
/* KVzip (arXiv 2505.23416): context-reconstruction scores after a full prefill (csrc/press/kvzip.c) */

/* The session holds the cache of its s->pos context tokens, full or compressed (rows evicted, heads ragged: a
 * conversation's later turn). The q_len reconstruction tokens `ids` (prompt + the context's text at positions
 * [start, end)) run on it; scores[L, Hkv, end - start] receive, at position - start, the most attention each row a
 * head holds at those positions gets from them (softmax over the rows it holds at positions < min(n_sink, start),
 * its chunk rows and the causal reconstruction rows; plus: KVzip+ normalisation); 0 at positions a head does not
 * hold. Their rows are dropped again afterwards. */
KVC_API kvc_status kvc_session_kvzip_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start,
                                           int64_t end, int32_t n_sink, int32_t plus, float *scores, int64_t n_scores);
/* Evict, of the C rows the cache holds (n = s->pos positions, scores[L, Hkv, n] by position), the int(C ratio)
 * lowest over all layers (layerwise: int(C_l ratio) of each layer's C_l), rows at positions < n_sink kept. On the
 * full cache of a context C = L Hkv n. */
KVC_API kvc_status kvc_session_kvzip_evict(kvc_session *s, const float *scores, int64_t n_scores, double compression_ratio,
                                           int32_t layerwise, int32_t n_sink);

/* The same on the rows held at positions [first, first + n) only (scores [L, Hkv, n], by position - first): the
 * others stay (a conversation's earlier turns, RestoreKV's restore rows). compression_ratio in [0, 1] (1: every
 * scored row goes). */
KVC_API kvc_status kvc_session_kvzip_evict_range(kvc_session *s, const float *scores, int64_t n_scores, int64_t first,
                                                 int64_t n, double compression_ratio, int32_t layerwise, int32_t n_sink);

/* ---------------------------------------------------------------------------------------------- */
/* KVgrad (openreview cg1wTCJjjk; csrc/press/kvgrad.c): KVzip's reconstruction with a gradient          */

/* The session holds the cache of its s->pos context tokens, full or compressed (kvc_session_kvzip_score). The q_len
 * reconstruction tokens `ids` (KVzip's prompt + the chunk of positions [start, end)) run on the host in fp32
 * (train/rows_grad.c) over that cache (each head over the rows it holds), read-only, at the
 * positions after it, through every layer; Phi = sum over the rows of ||h^L||^2 (the last layer's output before
 * the final norm) is differentiated through the rows' own K/V (the context's are constants). scores[L, Hkv,
 * end - start]: for the row c a head holds at position start + i (0 where it holds none), at layer l, KV head h,
 * the most over the rows p and the query heads hq of h's group of A[p, c] ||v_c W_o[:, hq]||_2 ||dPhi/da_p^l||_2, A
 * KVzip's softmax (over the sinks held, the chunk rows held and the causal reconstruction rows), a^l the residual
 * right after layer l's attention.
 * grad_norms [L, q_len] (may be NULL) receive ||dPhi/da_p^l||_2. The cache is not changed. A device model uses
 * an fp32 host copy of its file (kvc_model_host_weights). KVC_ERR_UNSUPPORTED for a sliding window shorter
 * than the positions spanned. */
KVC_API kvc_status kvc_session_kvgrad_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start,
                                            int64_t end, int32_t n_sink, float *scores, int64_t n_scores, float *grad_norms,
                                            int64_t n_grad_norms);

/* ---------------------------------------------------------------------------------------------- */
/* LoRA adapters and rows appended from embeddings (RestoreKV; csrc/train/lora.c, csrc/press/restorekv.c) */

/* The projections a LoRA adapter can sit on (PEFT's target_modules q_proj ... down_proj). */
typedef enum kvc_lora_target {
    KVC_LORA_Q = 0, KVC_LORA_K = 1, KVC_LORA_V = 2, KVC_LORA_O = 3, KVC_LORA_GATE = 4, KVC_LORA_UP = 5,
    KVC_LORA_DOWN = 6, KVC_LORA_N = 7
} kvc_lora_target;
typedef struct kvc_lora kvc_lora;
/* An empty set of adapters for the shapes of `model`. */
KVC_API kvc_status kvc_lora_new(const kvc_model *model, kvc_lora **out);
/* The adapter of projection `target` of `layer`: y = x W^T + scale (x A^T) B^T, a [rank, in], b [out, rank]
 * (copied; in and out must be the projection's), PEFT's lora_A / lora_B with scale = lora_alpha / rank (rslora:
 * / sqrt(rank)). B's rows are in the model's own order (a GGUF llama's q/k rows are permuted for its adjacent
 * RoPE pairs: permute B's likewise). */
KVC_API kvc_status kvc_lora_set(kvc_lora *lora, int32_t layer, int32_t target, int32_t rank, int64_t in, int64_t out,
                                const float *a, const float *b, float scale);
KVC_API void kvc_lora_free(kvc_lora *lora);
/* n rows given as input embeddings emb [n, hidden] run through the model on the host in fp32 over the session's
 * cache (every head must hold s->pos rows), at positions s->pos .. s->pos + n - 1, with the adapters of `lora`
 * (NULL: none) active for this pass only; their K/V are appended to every layer through the backend and the
 * position moves on by n. On failure nothing is appended. */
KVC_API kvc_status kvc_session_append_embeddings(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora);

/* ---------------------------------------------------------------------------------------------- */
/* KVCompose (arXiv 2509.05165; kvpress KVComposePress; csrc/press/kvcompose.c)                     */

/* The session holds the full cache of its s->pos context tokens. The q_len >= 2 prompt tokens `ids` (kvpress:
 * the context again) run on it; out[L, H, n_ctx] receives, per layer, attention head and context row, the
 * maximum (sum = 0) or the sum (sum = 1) over the prompt's queries of their softmax attention (over the context
 * and the causal prompt rows). The prompt's rows are dropped again afterwards. */
KVC_API kvc_status kvc_session_kvcompose_profile(kvc_session *s, const int32_t *ids, int64_t q_len, int32_t sum,
                                                 float *out, int64_t n_out);
/* KVCompose's eviction of the session's full context cache from per-attention-head statistics task[L, H, n]
 * (agg_task already applied): the group's max or mean (group_max), times ||v|| (add_v_norm), plus the mean over
 * the layer's KV heads (add_mean); counts from the composite scores (structured: per layer, the heads' max or
 * mean (head_max) of their sorted scores, the first layer the maximum over layers; else per head), each head
 * keeping its own top rows; the first lower_bound entries of every composite get +1e9. */
KVC_API kvc_status kvc_session_kvcompose_evict(kvc_session *s, const float *task, int64_t n_task, double compression_ratio,
                                               int32_t structured, int32_t group_max, int32_t head_max,
                                               int32_t add_v_norm, int32_t add_mean, int64_t lower_bound);

/* ---------------------------------------------------------------------------------------------- */
/* TAKE: chunked prefill with probe tokens and delayed eviction (TAKE-chunked-prefill-eviction.txt) */

typedef struct kvc_take_config {
    int64_t chunk_size;        /* Z tokens per chunk (4096) */
    int64_t budget;            /* B: tokens kept per KV head after the last chunk */
    int64_t warmup_budget;     /* B_warmup: layers < warmup_layers keep this many before the last chunk */
    int32_t warmup_layers;     /* W (half the layers); layers 0..W-1 share layer W-1's selection */
    int32_t kernel;            /* average pooling of the probe scores (7) */
    float alpha;               /* probe EMA: Qa_i = alpha Qa_{i-1} + (1 - alpha) Qprobe_i (0.2) */
    int32_t delayed;           /* 1: delayed eviction (paper); 0: every layer scores itself */
    const int32_t *probe_ids;  /* p probe tokens appended to every chunk; their K/V are never kept */
    int64_t n_probe;
    const kvc_press_spec *inner; /* a press whose scorer scores the rows (its window: the probes) instead of probe
                                  * attention, or NULL; copied by the call */
    int32_t prompt_cached;     /* 1: the session already holds the n prompt tokens, uncompressed (a shared
                                * prefill; needs n <= chunk_size): only the probes run, then the eviction */
} kvc_take_config;

KVC_API void kvc_take_config_defaults(kvc_take_config *cfg);
/* Prefill n tokens chunk by chunk, evicting after every chunk; logits of the last prompt token go
 * to `logits` ([vocab], may be NULL; not written when cfg->prompt_cached). The session must be
 * empty or hold a compressed past, or with prompt_cached hold exactly the n tokens' full cache. A past is
 * scored with the chunks under the press scope KVC_PRESS_SCOPE_CACHE; with KVC_PRESS_SCOPE_CALL only the rows
 * this call appends are scored and evicted (kvc_session_set_press_scope: a conversation's turns). */
KVC_API kvc_status kvc_session_prefill_take(kvc_session *s, const int32_t *ids, int64_t n,
                                            const kvc_take_config *cfg, float *logits);

/* ---------------------------------------------------------------------------------------------- */
/* Kernels of the CPU backend, exported for testing against references (row-major fp32).          */

/* C[m,n] = A[m,k] * B[n,k]^T (B is a weight matrix stored [out, in]). */
KVC_API kvc_status kvc_kernel_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k);
/* y[r,:] = x[r,:] / sqrt(mean(x^2) + eps) * w */
KVC_API kvc_status kvc_kernel_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps);
/* In place on x[n, heads, d] at positions pos[n]; inv_freq[d/2] from kvc_kernel_rope_freqs. */
KVC_API kvc_status kvc_kernel_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d,
                                   const float *inv_freq, int32_t pairing);
/* inv_freq[d/2] for a config (theta and Llama-3.1 scaling). With a partial rotary embedding (rope_dim < d)
 * the frequencies are in the engine's head layout: pairs i < rope_dim/2 turn, the others have frequency 0
 * (model/model.h, "Partial rotary"). */
KVC_API kvc_status kvc_kernel_rope_freqs(const kvc_config *cfg, float *inv_freq);
/* out[r, :] = silu(gate[r, :]) * up[r, :] */
KVC_API kvc_status kvc_kernel_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
/* Causal GQA attention over a ragged cache. q[n, H, d]; for KV head h, keys k[h] and values v[h]
 * are [past_len[h] + n, d] (the last n rows belong to the n queries, in order); query i sees the
 * first past_len[h] + i + 1 rows. out[n, H, d]. Tiled: memory O(tile), never n x n. */
KVC_API kvc_status kvc_kernel_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                        const float *const *k, const float *const *v,
                                        const int64_t *past_len, float scale, float *out);
/* Dequantise `n` values of GGUF tensor type `ggml_type` from `src` into fp32. */
KVC_API kvc_status kvc_kernel_dequantize(int32_t ggml_type, const void *src, size_t src_bytes, float *dst, int64_t n);
/* C[m,n] = A[m,k] W[n,k]^T with W in its file's format (n rows of k values of ggml type `ggml_type`, the
 * bytes of a GGUF tensor [k, n]; k a whole number of blocks): the native-weight GEMM. path: 0 as the
 * engine picks (integer / decoding GEMV up to a few rows, else the blocked GEMM), 1 the blocked GEMM
 * (decoding in its packing step), 2 the GEMV, 3 the GEMV with the plain-C integer dot products; for
 * Q4_0, Q4_1 and Q8_0 these run on a copy in the CPU backend's interleaved layout, as the engine keeps
 * them; 4 the GEMV on the file's layout as given. KVC_ERR_UNSUPPORTED for a type the CPU does not keep
 * natively. */
KVC_API kvc_status kvc_kernel_matmul_native(int32_t ggml_type, const float *a, const void *w, float *c, int64_t m,
                                            int64_t n, int64_t k, int32_t path);

/* Rows of a K/V cache storage type (kvc_kv_format) decoded to fp32, as the attention reads a stored tile:
 * rows stored alone (key_block 0: `rows` rows of w values, kvc_kv_row_bytes each, rows [r0, r0 + rows)
 * of src), or KIVI keys (key_block 1: rows [r0, r0 + rows) of one key block of fmt->group rows). src holds
 * src_bytes (checked against what the rows need); out [rows, w]. path 0: the CPU attention's decoder
 * (vector instructions where the build has AVX-512 or AVX2 + F16C: *vectorised says which, may be NULL),
 * 1: the plain-C decoder of the format's definition. */
KVC_API kvc_status kvc_kernel_kv_decode(const kvc_kv_format *fmt, int32_t key_block, const void *src, size_t src_bytes,
                                        int64_t r0, int64_t rows, int32_t w, int32_t path, float *out,
                                        int32_t *vectorised);

/* Rows of fp32 values encoded into a K/V cache storage type as a commit stores them: `rows` rows of w values
 * (x [rows, w]) into dst, rows stored alone (kvc_kv_row_bytes each; dst_bytes checked). path 0: the CPU
 * store's encoder (vector instructions for f16, bf16 and q8_0 where the build has them), 1: the plain-C
 * encoder of the format's definition. */
KVC_API kvc_status kvc_kernel_kv_encode(const kvc_kv_format *fmt, const float *x, int64_t rows, int32_t w, int32_t path,
                                        void *dst, size_t dst_bytes);
/* The decode step's products on stored rows, as the CPU attention runs them on a tile of a typed cache (each row
 * widened to fp32 in registers; KIVI's dequantisation folded into the products): keys are rows [r0, r0 + n) of
 * one key block (KIVI: fmt->group rows of d channels; key_bytes at keys) or of rows stored alone (f16, bf16,
 * q8_0), values n rows stored alone (value_bytes at values); s [rows, n] = q [rows, d] keys^T and
 * o [rows, d] += p [rows, n] values. n in [1, 64]. The whole tile is scored as a decode task's first tile; for
 * rows stored alone and n >= 2 the last n - n / 2 keys' scores then come from scoring them again as a later tile
 * of that task, reusing the queries the first prepared (q8_0's int16 rounding). KVC_ERR_UNSUPPORTED where this
 * build decodes such tiles to fp32 instead (no AVX-512 or AVX2 + F16C, or d or KIVI's value groups not a multiple of
 * 64 channels (32 with AVX2), or d above 256). *int16 (when not NULL): 1 where the build multiplies int16 weights by
 * the codes (AVX-512 VNNI; KIVI: q s per row, and p s per row and value group; q8_0: q per row, and p s per row and
 * 32-channel block; each rounded to int16 steps of its max |.| / 32767), 0 where it multiplies floats (f16, bf16,
 * and every type on other builds). */
KVC_API kvc_status kvc_kernel_kv_tile(const kvc_kv_format *fmt, const void *keys, size_t key_bytes, int64_t r0,
                                      const void *values, size_t value_bytes, int32_t n, int32_t d, int32_t rows,
                                      const float *q, float *s, const float *p, float *o, int32_t *int16);

/* ---------------------------------------------------------------------------------------------- */
/* Devices. Every device runs the same engine through its backend (docs/ARCHITECTURE.md):            */
/*   cpu       fp32 weights, activations and cache: the reference;                                  */
/*   cuda      a separate library (libkvpress_c_cuda.so, next to libkvpress_c.so) opened at run time,  */
/*             so this library never depends on CUDA: bf16 weights, activations and cache, fp32       */
/*             accumulation and residual stream;                                                     */
/*   emulated  the CUDA device's contract on the CPU (separate buffers, bf16 storage rounded where the */
/*             CUDA backend rounds, graphs recorded and replayed), so CI runs the device path.        */

typedef enum kvc_device { KVC_DEVICE_CPU = 0, KVC_DEVICE_CUDA = 1, KVC_DEVICE_EMULATED = 2 } kvc_device;

/* 1 when the device can be used (for CUDA: the library was built and a usable GPU is visible). Never fails. */
KVC_API int kvc_device_available(int32_t device);
/* KVC_OK, or KVC_ERR_DEVICE with the reason in kvc_last_error() ("CUDA backend not available: ..."). */
KVC_API kvc_status kvc_device_init(int32_t device);
/* "" when the device is not available. kvc_device_gemm_name says which GEMM runs (on CUDA, "cublas (...)",
 * or the built-in fallback, named as such when cuBLAS was not found). */
KVC_API const char *kvc_device_name(int32_t device);
KVC_API const char *kvc_device_gemm_name(int32_t device);
/* Bytes the device's backend holds, out[8]: current, peak, weights, cache, cache peak, activations,
 * activations peak, device total (0 on the host) (peaks since kvc_device_reset_peak). */
KVC_API kvc_status kvc_device_memory_stats(int32_t device, int64_t *out);
KVC_API kvc_status kvc_device_reset_peak(int32_t device);
/* Host-device traffic of the device's backend since the last reset, out[5]: downloads, uploads, syncs (waits of
 * the host for the device), bytes down, bytes up; reset != 0 starts the counters again after reading.
 * KVC_ERR_UNSUPPORTED on the CPU (no second memory). */
KVC_API kvc_status kvc_device_traffic(int32_t device, int32_t reset, int64_t *out);
/* Named settings of a device: CUDA and emulated take "builtin_gemm" (1: the built-in GEMM even where
 * cuBLAS was found) and "attention_kernel" (prefill attention: 0 the WMMA kernel, 1 the register-tile
 * mma.sync kernel where it applies, head_dim 64 or 128: other head dims run the generic kernel); the
 * emulated device also takes "fail_after" n (its (n+1)-th operation from now fails once with
 * KVC_ERR_DEVICE, as a CUDA error would; -1 cancels). KVC_ERR_ARG for others. */
KVC_API kvc_status kvc_device_set_option(int32_t device, const char *name, int32_t value);
/* Device-only timing (benchmarks; KVC_ERR_UNSUPPORTED without device timers): seconds per call, best of
 * reps after a warm-up, of the GEMM (what 0, dims {m, n, k}) or of the causal GQA prefill attention
 * (what 1, dims {n, H, Hkv, d}). */
KVC_API kvc_status kvc_device_bench(int32_t device, int32_t what, const int64_t *dims, int32_t reps, double *seconds);

/* Load a model onto a device: tensors go from the file's type to the device's, one bounded chunk at a
 * time (no host copy of the weights). Every session of the model runs there. */
KVC_API kvc_status kvc_model_load_device(const char *path, int32_t device, kvc_model **out);
KVC_API int32_t kvc_model_device(const kvc_model *model);

/* The kernels of a device on host arrays, with the contracts of the kvc_kernel_* functions above (inputs
 * stored as the device stores them, e.g. rounded to bf16; fp32 out), for tests against the CPU. */
KVC_API kvc_status kvc_device_kernel_matmul(int32_t device, const float *a, const float *b, float *c, int64_t m,
                                            int64_t n, int64_t k);
/* y = rmsnorm(x + r) * w; with r (may be NULL) x_out (may be NULL) receives x + r */
KVC_API kvc_status kvc_device_kernel_rmsnorm(int32_t device, const float *x, const float *r, const float *w, float *y,
                                             float *x_out, int64_t rows, int64_t dim, float eps);
KVC_API kvc_status kvc_device_kernel_rope(int32_t device, float *x, const int64_t *pos, int64_t n, int32_t heads,
                                          int32_t d, const float *inv_freq, int32_t pairing);
KVC_API kvc_status kvc_device_kernel_swiglu(int32_t device, const float *gate, const float *up, float *out, int64_t rows,
                                            int64_t dim);
/* In place on x[n, heads, d]: each head divided by its root mean square (+ eps), times w[d] (Qwen3's q/k norm). */
KVC_API kvc_status kvc_device_kernel_head_rmsnorm(int32_t device, float *x, int64_t n, int32_t heads, int32_t d,
                                                  const float *w, float eps);
/* force_prefill: a single query through the prefill kernel (the CUDA backend has a split-K decode kernel).
 * start (may be NULL): a sliding window, query i of KV head h sees rows >= start[i * Hkv + h] (nondecreasing
 * in i, at most past_len[h] + i). */
KVC_API kvc_status kvc_device_kernel_attention(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv,
                                               int32_t d, const float *const *k, const float *const *v,
                                               const int64_t *past_len, const int64_t *start, float scale, float *out,
                                               int32_t force_prefill);
/* The same with the scaled scores soft-capped, softcap tanh(s / softcap) before the softmax (Gemma 2's
 * attn_logit_softcapping; 0: none). */
KVC_API kvc_status kvc_device_kernel_attention_softcap(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv,
                                                       int32_t d, const float *const *k, const float *const *v,
                                                       const int64_t *past_len, const int64_t *start, float scale,
                                                       float softcap, float *out, int32_t force_prefill);
/* The same (no window) over a store whose rows [0, pruned_rows[h]) of KV head h keep only the dk key
 * channels kidx[h * dk + j] (increasing; ThinK's freed layout, core/backend.h): the other channels of
 * those rows of k are dropped, as if zero. */
KVC_API kvc_status kvc_device_kernel_attention_pruned(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv,
                                                      int32_t d, const float *const *k, const float *const *v,
                                                      const int64_t *past_len, const int64_t *pruned_rows, int32_t dk,
                                                      const int32_t *kidx, float scale, float *out, int32_t force_prefill);
/* Top-k of each of `heads` score rows [heads, n]: keep[h * n + i], i < min(k[h], n), sorted rows (higher
 * score first, ties to the lower row, NaN lowest). */
KVC_API kvc_status kvc_device_kernel_topk(int32_t device, const float *scores, int32_t heads, int64_t n, const int64_t *k,
                                          int64_t *keep);
/* A K/V store's row rules (core/kv_layout.h) on a device: a store of Hkv heads of d channels holding len
 * rows (room for len + 4), their keys pruned to the first dk channels when dk > 0 (ThinK's freed layout),
 * then op 0: read rows [row0, row0 + rows) of every head; 1: gather them; 2: write them; 3: read them in one
 * batched read (kv_read_heads), checked against op 0's rows; 4: write them in one batched write (kv_write_rows),
 * checked by reading them back. The status says whether the store allowed it (reads and gathers within the rows
 * held, writes within the room) and, for 3 and 4, KVC_ERR_INTERNAL when the rows moved differ. */
KVC_API kvc_status kvc_device_kernel_kv_rows(int32_t device, int32_t op, int32_t Hkv, int32_t d, int64_t len, int32_t dk,
                                             int64_t row0, int64_t rows);
/* The mixture-of-experts kernels (core/backend.h's moe_route, gather_rows, moe_combine) on host arrays. Routing: for
 * each of n rows of router logits [n, E], p = softmax(row); ids[n, k] the k experts of highest p, highest first
 * (ties: the lower expert; NaN lowest), w[n, k] their p, divided by the sum of those k when norm. Gather:
 * dst[i] = src[idx[i]] for i < n over src [src_rows, D]. Combine: x[r] += sum over j < k of w[r, j] y[pos[r, j]]
 * (x [n, D] in place, y [n k, D], w and pos [n, k]). */
KVC_API kvc_status kvc_device_kernel_moe_route(int32_t device, const float *logits, int64_t n, int32_t E, int32_t k,
                                               int32_t norm, int32_t *ids, float *w);
KVC_API kvc_status kvc_device_kernel_gather_rows(int32_t device, const float *src, int64_t src_rows, const int32_t *idx,
                                                 int64_t n, int64_t D, float *dst);
KVC_API kvc_status kvc_device_kernel_moe_combine(int32_t device, float *x, const float *y, const float *w, const int32_t *pos,
                                                 int64_t n, int32_t k, int64_t D);
/* A K/V store of storage type fmt (kvc_kv_format; NULL: the device's own) as a session fills it: the rows k, v
 * [Hkv, n, d] (head after head) arrive `step` rows at a time (the last call fewer), each call's rows written past
 * the held ones (kv_write), held (kv_set_lens) and committed (kv_commit), as a layer's append and its attention
 * do, into room for n rows made first (kv_resize); then every head's rows come back in f32 into k_out, v_out
 * [Hkv, n, d] and *bytes receives the store's kv_bytes (its arena, and rows waiting in f32 as f32). */
KVC_API kvc_status kvc_device_kernel_kv_store(int32_t device, const kvc_kv_format *fmt, int32_t Hkv, int32_t d, int64_t n,
                                              int64_t step, const float *k, const float *v, float *k_out, float *v_out,
                                              size_t *bytes);
/* Decode steps replayed as a graph (a device with graphs: CUDA, emulated; default from KVC_DECODE_GRAPHS=1).
 * The first decode step after a capture is needed runs eagerly; a failed capture turns graphs off for the
 * session and says why in kvc_session_graph_info. KVC_ERR_UNSUPPORTED on a device without graphs. */
KVC_API kvc_status kvc_session_set_decode_graphs(kvc_session *s, int32_t on);
/* on: graphs enabled; graph_steps: decode steps that ran as a graph; error: why graphs were turned off ("" if not). */
KVC_API kvc_status kvc_session_graph_info(const kvc_session *s, int32_t *on, int64_t *graph_steps, const char **error);

/* ---------------------------------------------------------------------------------------------- */
/* Judge Q training (JudgeQ-trainable-queries.txt Eq. 3-5, docs/METHODS.md "Judge Q")                   */

/* Loss and gradient of soft-token embeddings `soft` [n_soft, hidden] for one (prompt, response) pair.
 * Maps per layer l and query head h over the n_prompt prompt positions j: A_resp[l, h, j] is the mean
 * over the response rows of a forward of prompt + response of their causal softmax attention (over
 * everything each row sees), read at prompt position j, not renormalised; A_soft likewise for the soft
 * rows of a forward of prompt + soft (soft rows at positions n_prompt .. n_prompt + n_soft - 1, as
 * JudgeQPress runs them). loss = mean over (l, h, j) of (A_soft - A_resp)^2.
 * grad [n_soft, hidden] receives dL/dsoft (NULL: loss only). soft_maps and response_maps, each
 * [n_layers, n_heads, n_prompt], receive A_soft and A_resp (either may be NULL). Runs on the host in
 * fp32 (a device model loads a CPU copy of its file the first time, 4 bytes per parameter of host memory,
 * kept until the model is freed); reentrant. The backward runs over the soft rows only: memory is the
 * prompt's K/V plus O(n_soft) activations per layer. */
KVC_API kvc_status kvc_judgeq_loss_grad(kvc_model *model, const int32_t *prompt_ids, int64_t n_prompt,
                                        const int32_t *response_ids, int64_t n_response, const float *soft,
                                        int64_t n_soft, double *loss, float *grad, float *soft_maps,
                                        float *response_maps);

/* The same, split for training loops that see a pair many times (epochs): kvc_judgeq_pair_new runs
 * the prompt + response forward once and keeps the prompt's K/V (room for max_soft soft rows) and
 * the target A_resp; kvc_judgeq_pair_loss_grad then costs only the soft rows' forward and backward (more
 * than max_soft rows grow the pair). A pair holds n_layers * n_kv_heads * (n_prompt + max_soft) * head_dim * 2 floats
 * (kvc_judgeq_pair_bytes); one call at a time per pair (a concurrent call fails with KVC_ERR_ARG). */
typedef struct kvc_judgeq_pair kvc_judgeq_pair;
KVC_API kvc_status kvc_judgeq_pair_new(kvc_model *model, const int32_t *prompt_ids, int64_t n_prompt,
                                       const int32_t *response_ids, int64_t n_response, int64_t max_soft,
                                       kvc_judgeq_pair **out);
KVC_API kvc_status kvc_judgeq_pair_loss_grad(kvc_judgeq_pair *pair, const float *soft, int64_t n_soft,
                                             double *loss, float *grad, float *soft_maps, float *response_maps);
KVC_API void kvc_judgeq_pair_free(kvc_judgeq_pair *pair);
KVC_API size_t kvc_judgeq_pair_bytes(const kvc_judgeq_pair *pair);
KVC_API int64_t kvc_judgeq_pair_prompt_len(const kvc_judgeq_pair *pair);
/* Input embeddings of n token ids: out [n, hidden] (to initialise soft tokens from real tokens). */
KVC_API kvc_status kvc_model_token_embeddings(const kvc_model *model, const int32_t *ids, int64_t n, float *out);

#ifdef __cplusplus
}
#endif
#endif /* KVPRESS_C_H */
