/* Internal header of the device engine: device model, device session (ragged cache + scratch),
 * the layer context hooks see. Shared by engine.cu (model, cache, forward), press.cu (press ops)
 * and api.cu (the exported table). */
#ifndef KVC_CUDA_ENGINE_CUH
#define KVC_CUDA_ENGINE_CUH

#include <vector>

#include "common.cuh"

namespace kvc {

struct DLayer {
    bf16 *wqkv;      /* [qd + 2 kd, D]: q | k | v projections fused (one GEMM) */
    float *bqkv;     /* [qd + 2 kd] or NULL */
    bf16 *wo;        /* [D, qd] */
    bf16 *wgu;       /* [2F, D]: gate | up fused */
    bf16 *wdown;     /* [D, F] */
    float *attn_norm, *ffn_norm;
};

struct DModel {
    kvc_config c;
    bf16 *tok;       /* [V, D] */
    bf16 *lm_head;   /* [V, D] (== tok when tied) */
    float *out_norm; /* [D] */
    float *inv_freq; /* [d/2] */
    std::vector<DLayer> layers;
    struct Alloc {
        void *p;
        size_t bytes;
    };
    std::vector<Alloc> allocs;
    size_t bytes = 0;
};

#define DECODE_SPLITS 64 /* split-K partitions of the decode attention */
#define MLP_ROWS 8192    /* rows per MLP block: gate|up activations stay O(block x ffn) */

struct DSess {
    DModel *m;
    int32_t L, Hkv, d;
    /* ragged cache: host mirror of lengths, capacities and positions; one device arena per layer
     * holding, per head, K [cap, d] then V [cap, d] */
    int64_t *len, *cap; /* [L * Hkv] */
    int32_t *len32;     /* [L * Hkv] host staging for lend */
    int64_t **pos;      /* [L * Hkv] -> [cap] original positions (host) */
    void **arena;       /* [L] */
    size_t *arena_bytes;
    bf16 **kh, **vh;    /* [L * Hkv] device pointers, host copy */
    bf16 **kd, **vd;    /* [L * Hkv] the same on the device (kernels read them) */
    int32_t *lend;      /* [L * Hkv] device lengths */
    void *dev_tables;   /* the one allocation behind kd, vd and lend */
    size_t dev_tables_bytes;
    size_t cache_bytes, cache_peak;
    /* activations of the last forward */
    Buf x, xn, qkv, att, o, gu, logits, ids, posd, partial;
    /* press scratch */
    Buf scores, att_s, stats, rows_d, topk_tmp, dsum, probe_q;
    int64_t scores_ld;
    int32_t *keep32; /* host staging for selections */
    size_t keep32_cap;
    /* decode step as a CUDA graph (KVC_CUDA_GRAPHS=1): valid while the buffers it baked in stay */
    cudaGraphExec_t gexec;
    const void *gsig[11];
    int graph_off; /* capture failed once: eager from then on */
};

struct DevCtx {
    DSess *s;            /* the session that ran the forward */
    int32_t layer;
    int64_t n;
    const bf16 *q;       /* rows of stride ldq: q at column 0 (after RoPE) */
    int64_t ldq;
    const bf16 *attn;    /* [n, qd] */
    const bf16 *o;       /* [n, D] */
    const float *resid;  /* [n, D] the residual stream entering the block */
};

/* engine.cu */
kvc_status reserve(DSess *s, int32_t l, int64_t extra);
/* Re-pack layer l into an arena with new_cap[h] rows per head; keep (device int32, concatenated
 * per head, n_keep[h] each) selects the rows, or NULL to keep the first min(len, new_cap) rows of
 * the layer, or of the same layer of session `from` when given (a copy). */
kvc_status layer_repack(DSess *s, int32_t l, const int64_t *new_cap, const int32_t *keep_d, const int64_t *n_keep,
                        const int64_t *const *keep_host, const DSess *from = nullptr);
kvc_status upload_lens(DSess *s, int32_t l);
kvc_status model_upload(const kvc_model *m, DModel **out);
void model_free(DModel *dm);
kvc_status session_new(DModel *dm, DSess **out);
void session_free(DSess *s);
void session_clear(DSess *s);
/* Make dst (emptied first) an exact copy of src's cache; on failure dst is left empty. */
kvc_status session_copy(DSess *dst, const DSess *src);
kvc_status forward(DSess *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb, int64_t pos0,
                   int64_t logits_row, float *logits, kvc_dev_hook hook, void *hook_user, DSess *const *fol,
                   const kvc_dev_hook *fh, void *const *fu, int32_t nf);
kvc_status forward_batch(DSess *const *ss, int32_t B, const int32_t *ids, const int64_t *pos, float *logits);
/* HeadInfo of a layer (pointers and lengths; n_acc = len, visibility unset). */
HeadInfo head_info(const DSess *s, int32_t l);

/* press.cu */
/* scores of a layer for a scorer the device has (KVC_ERR_UNSUPPORTED otherwise): q rows (stride ldq)
 * are this call's n queries, attn rows (stride ld_attn) their attention outputs (EDIE; may be NULL
 * for the other scorers), the cache rows hi (len), past = len - n */
kvc_status score_layer(const HeadInfo &hi, int32_t H, int32_t Hkv, int32_t d, const bf16 *q, int64_t ldq,
                       const bf16 *attn, int64_t ld_attn, int64_t n, const kvc_press_config *cfg, int32_t layer,
                       Buf &att_s, Buf &stats, float *scores, int64_t lds);

} // namespace kvc

/* the opaque context of cuda_api.h */
struct kvc_dev_ctx {
    kvc::DevCtx c;
};

#endif
