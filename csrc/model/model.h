/* The in-memory model: its config and its weights as views of buffers of the backend it runs on,
 * independent of the file format it came from. Loaders (gguf_model.c, hf_model.c) read the config,
 * create the model (every weight buffer allocated on the backend, or, for a weight used in place, a
 * read-only buffer over the mapped file) and stream each tensor of the file into place (kvc_model_put):
 * converted from the file's type to the backend's, a bounded chunk of rows at a time, so a device load
 * never holds a host copy of the weights; a weight used in place is only checked. */
#ifndef KVC_MODEL_H
#define KVC_MODEL_H

#include <pthread.h>

#include "../core/backend.h"
#include "../core/common.h"

struct gguf_file;

/* A projection whose outputs sit side by side: q|k|v, gate|up. One buffer holding every part's rows in
 * order (all of one dtype, copied or mapped from a file that stores them back to back) is `whole`: one
 * GEMM. Otherwise (parts of different file types, or each mapped where it lies in the file) whole.buf is
 * NULL and each part is its own matrix: one GEMM each, into its columns of the output. */
typedef struct kvc_wgroup {
    kvc_view whole;
    kvc_view part[3];
    int64_t rows[3];
    int32_t n;
} kvc_wgroup;

/* Linear weights are [out, in] row-major (y = x W^T), as in both GGUF and safetensors. Norm weights and
 * biases are f32. */
typedef struct kvc_layer_weights {
    kvc_view attn_norm; /* [D] */
    kvc_wgroup qkv;     /* [qd + 2 kd, D]: q rows, then k, then v */
    kvc_view bqkv;      /* [qd + 2 kd], buf NULL unless cfg.qkv_bias */
    kvc_view q_norm;    /* [d] per-head RMSNorm of q, buf NULL unless cfg.qk_norm */
    kvc_view k_norm;    /* [d] the same for k */
    kvc_view wo;        /* [D, qd] */
    kvc_view ffn_norm;  /* [D] */
    kvc_wgroup gu;      /* [2F, D]: gate rows, then up */
    kvc_view wdown;     /* [D, F] */
    kvc_view post_attn_norm; /* [D] RMSNorm of the attention output, buf NULL unless cfg.post_norms */
    kvc_view post_ffn_norm;  /* [D] RMSNorm of the MLP output, the same */
    /* A mixture-of-experts layer (kvc_layer_moe) has these instead of gu and wdown (NULL in a dense layer): */
    kvc_view router;         /* [E, D] */
    kvc_wgroup *exp_gu;      /* [E]: expert e's gate rows then its up rows, [moe_ffn, D] each (kvc_model_create
                                says how the experts share buffers) */
    kvc_view *exp_down;      /* [E]: expert e's [D, moe_ffn] */
} kvc_layer_weights;

/* C[m, sum of rows] = A[m, k] G^T: one matmul for a whole group, else one per part into its columns. */
kvc_status kvc_wgroup_matmul(const kvc_backend *be, kvc_view a, const kvc_wgroup *g, kvc_view c, int64_t m, int64_t k);

/* A backend buffer the model owns; `mapped`: the file's bytes it wraps (weights used in place), else NULL. */
typedef struct kvc_model_buf {
    kvc_buf *buf;
    int32_t dtype; /* a buffer is opaque to the engine */
    const void *mapped;
} kvc_model_buf;

/* fp32 host pointers to the weights, for algorithms that run on the host (train/rows_grad.c). q_norm, k_norm
 * and the biases are NULL where the model has none. */
typedef struct kvc_host_layer {
    const float *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *ffn_norm, *w_gate, *w_up, *w_down, *q_norm, *k_norm;
} kvc_host_layer;
typedef struct kvc_host_weights {
    const float *tok_embd, *out_norm, *lm_head;
    const struct kvc_model *rope; /* the model whose RoPE rule (kvc_model_rope) turns the rows */
    kvc_host_layer *layers;
} kvc_host_weights;

struct kvc_model {
    kvc_config cfg;
    char format[16];          /* "gguf" or "safetensors" */
    char *path;               /* the file or folder it was loaded from */
    const kvc_backend *be;
    kvc_kv_format kv_format;  /* the K/V type new sessions get (KVC_KV_NATIVE after load) */
    kvc_view tok_embd;        /* [V, D] */
    kvc_view out_norm;        /* [D] */
    kvc_view lm_head;         /* [V, D]; the token embedding when tied */
    kvc_view inv_freq;        /* [d/2] f32 RoPE frequencies (LongRoPE: the short factors') */
    kvc_view inv_freq_long;   /* [d/2] LongRoPE's long factors' frequencies; buf NULL without LongRoPE */
    kvc_view inv_freq_local;  /* [d/2] the sliding layers' frequencies (cfg.rope_local_theta); buf NULL without */
    int norm_plus_one;        /* norm weights are stored as w and used as 1 + w (Gemma's HF files): added at load */
    int embed_scale_rounded;  /* cfg.embed_scale is cast to the dtype the embedding is held in (transformers' Gemma) */
    kvc_layer_weights *layers;
    float *rope_factors;      /* host [d/2]: GGUF rope_freqs.weight (Llama-3.1) times linear scaling, LongRoPE's short
                                 factors, or NULL */
    float *rope_long_factors; /* host [d/2]: LongRoPE's long factors, or NULL */
    float *rope_inv_freq;     /* host [d/2]: inv_freq's values */
    float *rope_inv_freq_long;  /* host [d/2]: inv_freq_long's, or NULL */
    float *rope_inv_freq_local; /* host [d/2]: inv_freq_local's, or NULL */
    size_t weight_bytes;      /* every weight, mapped ones included */
    size_t mapped_bytes;      /* of which used in place in the mapped file (page cache, shared) */
    int32_t weights;          /* KVC_WEIGHTS_NATIVE or KVC_WEIGHTS_FP32, as asked at load */
    int32_t n_native;         /* weight tensors kept in their file's type */
    kvc_model_buf *bufs;      /* the backend buffers the model owns */
    size_t n_bufs, cap_bufs;
    struct gguf_file *meta;   /* GGUF metadata kept for the tokenizer (and its mapping, which mapped weights
                                 point into); NULL for HF folders */
    void *files;              /* HF: the opened safetensors shards mapped weights point into, or NULL */
    void (*close_files)(void *files);
    /* host fp32 weights on demand (kvc_model_host_weights): a CPU model's own buffers, or a CPU copy of
     * the file for a device model, loaded the first time a host algorithm asks */
    pthread_mutex_t host_lock;
    kvc_host_weights *host;
    struct kvc_model *host_twin;
    char digest[72];          /* "sha256:..." of its weight files, computed once under host_lock (persist/) */
};

/* Where a tensor of the file goes. */
typedef enum kvc_weight_role {
    KVC_W_TOK, KVC_W_OUT_NORM, KVC_W_LM_HEAD,
    KVC_W_ATTN_NORM, KVC_W_Q, KVC_W_K, KVC_W_V, KVC_W_O, KVC_W_BQ, KVC_W_BK, KVC_W_BV,
    KVC_W_FFN_NORM, KVC_W_GATE, KVC_W_UP, KVC_W_DOWN, KVC_W_Q_NORM, KVC_W_K_NORM,
    KVC_W_QKV, KVC_W_GU, /* fused files (Phi-3): q|k|v rows in one tensor, gate|up rows in one tensor */
    KVC_W_POST_ATTN_NORM, KVC_W_POST_FFN_NORM, /* Gemma's norms of the attention and MLP outputs */
    KVC_W_ROUTER, KVC_W_GATE_EXP, KVC_W_UP_EXP, KVC_W_DOWN_EXP /* an MoE layer's router and one expert's matrices */
} kvc_weight_role;

/* One expert of a layer's stack of n: which matrix of a role a tensor is (GGUF: slice e of the 3-D tensor;
 * Hugging Face: the tensor of expert e). NULL where a role is one matrix. */
typedef struct kvc_expert {
    int32_t e, n;
} kvc_expert;

/* A decoder layer's tensors as the files name them: GGUF after "blk.N.", Hugging Face after
 * "model.layers.N." (biases only in models with qkv_bias, q/k norms only with qk_norm; the fused q|k|v and
 * gate|up tensors in fused models instead of their parts, kvc_fused_proj). Both loaders walk this one list.
 *
 * Fused projections are kept fused: their rows are the whole q|k|v (gate|up) group in the order the engine
 * reads it, so the tensor streams into the group's one buffer (one GEMM, as for separate tensors copied).
 *
 * Partial rotary (cfg.rope_dim < head_dim): the file's head turns its first rope_dim values (pairs (i, i +
 * rope_dim/2)) and passes the rest. The loader permutes each q and k head's rows so that the turned pairs
 * become the engine's (i, i + d/2) pairs i < rope_dim/2 and the passed values the pairs above, whose
 * frequency is 0: q.k is unchanged (the same permutation on both), and every RoPE on the host (re-rotation,
 * ExpectedAttention's future positions) stays the plain whole-head one. */
typedef struct kvc_layer_tensor {
    kvc_weight_role role;
    const char *gguf, *hf; /* an expert's Hugging Face name has a %d: the expert's index */
} kvc_layer_tensor;
#define KVC_LAYER_TENSORS 22
/* A layer tensor's name in a file of this model (Gemma's HF files call the MLP's norm
 * pre_feedforward_layernorm; their post_attention_layernorm is the attention output's norm; Mixtral's call the
 * MoE block block_sparse_moe and its experts' gate, down and up w1, w2 and w3). */
const char *kvc_layer_tensor_name(const kvc_config *c, const kvc_layer_tensor *t, int hf);
/* The full name of layer l's tensor t (of expert x->e where the role is an expert's) in a file of this model:
 * "blk.l.name" (GGUF) or "model.layers.l.name" (hf). */
void kvc_layer_tensor_path(const kvc_config *c, const kvc_layer_tensor *t, int hf, int32_t l, const kvc_expert *x,
                           char *buf, size_t cap);
/* Layer l's MLP is a mixture of experts (kvc_config's n_experts, moe_step and moe_dense). */
int kvc_layer_moe(const kvc_config *c, int32_t l);
/* Layer l attends within the sliding window (Gemma 3 interleaves: with window_period P, every P-th layer,
 * (l + 1) % P == 0, attends to the whole cache). */
int kvc_layer_slides(const kvc_config *c, int32_t l);
/* The presses act on layer l: every layer, but on Gemma 3 (interleaved windows) only the full-attention ones,
 * as kvpress compresses Gemma 3 (its hooks skip the layers with is_sliding; docs/METHODS.md "Gemma 3"). */
int kvc_layer_pressed(const kvc_config *c, int32_t l);
/* KVC_ERR_UNSUPPORTED naming `what` when some layer is not pressed (Gemma 3): for the methods that select
 * over every layer's cache at once (KVzip, Fast KVzip, KVCompose, TAKE), not defined there yet. */
kvc_status kvc_require_every_layer_pressed(const kvc_config *c, const char *what);
/* The scale of the model's attention scores: cfg.attn_scale (Gemma's query_pre_attn_scalar^-1/2), else
 * 1/sqrt(head_dim). What reproduces the model's own attention (ObservedAttention, Ada-KV's eviction loss)
 * uses it; scorers that define their own attention (SnapKV's window, ...) keep 1/sqrt(d) as kvpress does. */
float kvc_attn_scale(const kvc_config *c);
/* RoPE as the forward turns layer l's rows in a call whose last position + 1 is `end`: the one rule, read by
 * the forward (the device frequencies) and by everything that turns rows on the host (presses, the host pass).
 * LongRoPE: the long factors' frequencies once end passes the original context (transformers' longrope
 * update), the short ones' before; Gemma 3's sliding layers: their own base. mscale: the attention factor
 * that multiplies the turned pairs (LongRoPE's; 1 otherwise); pairs of frequency 0 pass unscaled. */
typedef struct kvc_rope_rule {
    kvc_view freq;      /* [d/2] on the model's backend */
    const float *host;  /* the same values on the host */
    float mscale;
} kvc_rope_rule;
kvc_rope_rule kvc_model_rope(const kvc_model *m, int32_t l, int64_t end);
/* Whether a call ending at `end` turns with LongRoPE's long factors (a decode graph is captured again when
 * this changes). */
int kvc_rope_long(const kvc_config *c, int64_t end);
/* The model's files fuse q|k|v and gate|up (Phi-3). */
int kvc_fused_proj(const kvc_config *c);
extern const kvc_layer_tensor kvc_layer_tensors[KVC_LAYER_TENSORS];
/* A loader's reader of one named tensor into a role: checks the file's shape against [rows, cols] (rows 0:
 * a vector; x: expert x->e's [rows, cols] of the role's stack of x->n) and streams it in with kvc_model_put. */
typedef kvc_status (*kvc_put_fn)(const void *file, kvc_model *m, kvc_weight_role role, int32_t layer, const char *name,
                                 int64_t rows, int64_t cols, const kvc_expert *x);
/* Every layer's tensors the model has (biases only with qkv_bias, q/k norms only with qk_norm), named the GGUF way (hf 0) or the
 * Hugging Face way (hf 1), through put. */
kvc_status kvc_model_put_layers(kvc_model *m, int hf, kvc_put_fn put, const void *file);

/* A tensor of a model file as a loader hands it over: logical shape [rows, cols] (a vector: rows 1)
 * and how to decode a range of its rows to fp32. */
typedef struct kvc_src {
    const char *name;
    int64_t rows, cols;
    kvc_status (*decode)(const struct kvc_src *s, int64_t r0, int64_t nr, float *dst);
    const void *data;  /* the file's bytes of the tensor (mapped): used in place, or released row range by row
                          range once converted */
    size_t row_bytes;  /* bytes of one row in the file */
    int32_t type;      /* the loader's own type code */
    const void *ctx;   /* the loader's own description of the tensor */
    int32_t ggml_type; /* the file's type as a ggml type id (safetensors F32/F16/BF16 too), -1 if none */
} kvc_src;

/* A loader's description of tensor `name` of the file as a source of [rows, cols] (rows 0: a vector),
 * its shape and type checked (the loaders' put functions use the same). */
typedef kvc_status (*kvc_describe_fn)(const void *file, const char *name, int64_t rows, int64_t cols, const kvc_expert *x,
                                      kvc_src *out);

/* Validate `cfg` (positive sizes, H % Hkv == 0, at most KVC_MAX_KV_HEADS KV heads, the backend's own
 * limits, ...) and create a model on `be` with every weight buffer in place (uninitialised, or mapped).
 * With weights == KVC_WEIGHTS_NATIVE, a matrix whose file type the backend takes (weight_type_ok) keeps
 * that type; every other goes to be->weight_dtype; a matrix whose bytes in memory equal the file's is
 * used in place (model.c: maps()) when the caller keeps the file mapped for the model's lifetime.
 * describe(file, ...) names tensors the Hugging Face way when hf, else the GGUF way. */
kvc_status kvc_model_create(const kvc_config *cfg, const char *format, const char *path, const kvc_backend *be,
                            int32_t weights, int hf, kvc_describe_fn describe, const void *file, kvc_model **out);
/* Stream tensor src into the weight of role `role` (layer: for per-layer roles; expert: the expert's matrix of an
 * expert role, else -1). */
kvc_status kvc_model_put(kvc_model *m, kvc_weight_role role, int32_t layer, int32_t expert, const kvc_src *src);
/* The model's host array of d/2 RoPE factors (GGUF rope_freqs.weight, linear scaling), allocated on first
 * call (NULL when out of memory); kvc_model_finish divides the frequencies by them. */
float *kvc_model_rope_factors(kvc_model *m);
/* The same for LongRoPE's long factors (kvc_model_finish makes inv_freq_long from them). */
float *kvc_model_rope_long_factors(kvc_model *m);
/* After every tensor is in: RoPE frequencies (with the rope factors), uploaded. */
kvc_status kvc_model_finish(kvc_model *m);
/* A config with every field at a neutral default (no scaling, no bias, bos/eos -1). */
void kvc_config_defaults(kvc_config *cfg);
/* fp32 host weights (see struct kvc_model); the pointers live as long as the model. */
kvc_status kvc_model_host_weights(kvc_model *m, const kvc_host_weights **out);
/* The model whose buffers those weights are: m itself on the CPU, else its host copy (after
 * kvc_model_host_weights). */
kvc_model *kvc_model_host_model(kvc_model *m);

/* Format-specific loaders onto a backend (model/gguf_model.c, model/hf_model.c). */
kvc_status kvc_load_gguf(const char *path, const kvc_backend *be, int32_t weights, kvc_model **out);
kvc_status kvc_load_hf(const char *dir, const kvc_backend *be, int32_t weights, kvc_model **out);

#endif
