/* The in-memory model: config plus fp32 weights (CPU backend layout), independent of the file
 * format it came from. Loaders fill it through kvc_model_alloc / kvc_model_finish. */
#ifndef KVC_MODEL_H
#define KVC_MODEL_H

#include "../core/common.h"

struct gguf_file;

/* Linear weights are stored [out, in] row-major (y = x W^T), as in both GGUF and safetensors. */
typedef struct kvc_layer_weights {
    float *attn_norm; /* [D] */
    float *wq;        /* [H*d, D] */
    float *wk;        /* [Hkv*d, D] */
    float *wv;        /* [Hkv*d, D] */
    float *wo;        /* [D, H*d] */
    float *bq, *bk, *bv; /* [H*d], [Hkv*d], [Hkv*d]; NULL unless cfg.qkv_bias */
    float *ffn_norm;  /* [D] */
    float *w_gate;    /* [F, D] */
    float *w_up;      /* [F, D] */
    float *w_down;    /* [D, F] */
} kvc_layer_weights;

struct kvc_model {
    kvc_config cfg;
    char format[16];            /* "gguf" or "safetensors" */
    float *tok_embd;            /* [V, D] */
    float *out_norm;            /* [D] */
    float *lm_head;             /* [V, D]; == tok_embd when tied */
    kvc_layer_weights *layers;  /* [n_layers] */
    float *rope_factors;        /* [d/2] GGUF rope_freqs.weight (Llama-3.1), or NULL */
    float *rope_inv_freq;       /* [d/2], computed by kvc_model_finish */
    size_t weight_bytes;
    struct gguf_file *meta;     /* GGUF metadata kept for the tokenizer; NULL for HF folders */
    void *cuda;                 /* bf16 copy on the GPU (backend/cuda_loader.c), or NULL: CPU only */
    /* every buffer the model owns, freed by kvc_model_free */
    void **owned;
    size_t n_owned, cap_owned;
};

/* Validate `cfg` (positive sizes, H % Hkv == 0, D == H * d unless the arch allows otherwise, ...)
 * and allocate every weight buffer (uninitialised) for it. */
kvc_status kvc_model_alloc(const kvc_config *cfg, const char *format, kvc_model **out);
/* Allocate an extra owned buffer of n floats (e.g. rope_factors). */
float *kvc_model_alloc_floats(kvc_model *m, size_t n, const char *what);
/* After all weights are filled: tie lm_head if needed, compute RoPE frequencies. */
kvc_status kvc_model_finish(kvc_model *m);
/* A config with every field at a neutral default (no scaling, no bias, bos/eos -1). */
void kvc_config_defaults(kvc_config *cfg);

/* Format-specific loaders (model/gguf_model.c, model/hf_model.c). */
kvc_status kvc_load_gguf(const char *path, kvc_model **out);
kvc_status kvc_load_hf(const char *dir, kvc_model **out);

#endif
