/* The press engine: scorer x allocation x selection, applied by the schedule (here: right after
 * each layer's attention during a prefill, as kvpress does). Internal API between its files. */
#ifndef KVC_PRESS_H
#define KVC_PRESS_H

#include "../engine/session.h"

/* Per-session press state: config, recorded diagnostics and scratch. */
typedef struct kvc_press {
    kvc_press_config cfg;
    int32_t n_layers, n_kv;
    float **scores;      /* [L * Hkv] recorded scores (record_scores), or NULL */
    int64_t *score_len;  /* [L * Hkv] */
    double *error;       /* [L] eviction loss, NAN when not computed */
    /* layer-wise index reuse (ChunkKV): the rows the group's first layer kept */
    int64_t *reuse_rows;   /* [Hkv * reuse_len] */
    int64_t *reuse_n;      /* [Hkv] */
    int64_t reuse_len;     /* rows the heads held when the indices were chosen; 0: none */
    double *layer_seconds; /* [L] time spent scoring + selecting per layer */
    int64_t *layer_totals; /* [L] KVC_ALLOC_LAYER budgets (tokens over the layer's heads); -1 unset */
    double *e_internal;    /* [L] TADA: sum of the scores over heads and past rows */
    double *dissim;        /* [L] TADA: 1 - cos(R, R + O) averaged over the window tokens */
} kvc_press;

/* What the scorers see: the layer's cache and this call's queries. */
typedef struct kvc_score_input {
    const kvc_config *cfg;
    const kvc_layer_cache *cache;
    const kvc_layer_ctx *ctx;
    const kvc_press_config *press;
} kvc_score_input;

/* scores[h] has cache->len[h] entries (caller-allocated). Protected rows (window, sinks) get
 * max + 1 so they sort first without +inf arithmetic. */
kvc_status kvc_press_score(const kvc_score_input *in, float *const *scores);

/* Mean over the window queries of each query head's softmax attention on rows [0, len_h - w):
 * out[hq] has len_h - w entries. Causal inside the window. */
void kvc_window_attention(const kvc_score_input *in, int32_t w, float *const *out);

/* Tokens to keep per head for this layer, from the press config (uniform, pyramid) or from the
 * scores (Ada-KV, which also fills keep rows itself). Returns rows to keep, sorted, per head. */
kvc_status kvc_press_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv,
                            const int64_t *len, const float *const *scores, int32_t window, int64_t layer_total,
                            int64_t **keep, int64_t *n_keep);
/* EDIE scorer (edie.c) */
kvc_status kvc_score_edie(const kvc_score_input *in, float *const *scores);
/* Attention probabilities of m queries against one head's rows, with one GEMM: q_rows [m, d]
 * contiguous, k [len, d]; query i sees rows [0, visible[i]); probs [m, len] (zeros past visible). */
void kvc_probs_rows(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                    const int64_t *visible, float *probs);

/* Gather the query rows [first, first + m) of query head hq from ctx->q into dst [m, d]. */
void kvc_gather_queries(const kvc_layer_ctx *ctx, int32_t H, int32_t d, int32_t hq, int64_t first, int64_t m, float *dst);

/* Scorers that protect an observation window at the end of the cache. */
static inline int kvc_scorer_has_window(int32_t scorer) {
    return scorer == KVC_SCORE_SNAPKV || scorer == KVC_SCORE_EDIE;
}

/* Budget helpers shared with the tests' references (kvpress semantics). */
int64_t kvc_n_kept_ratio(int64_t n, double compression_ratio);
int64_t kvc_layer_budget(const kvc_press_config *p, int32_t layer, int32_t n_layers, int64_t n);

/* ChunkKV: one selection of whole chunks shared by every head (scores summed over heads).
 * keep_rows receives sorted rows; returns the count through *n_keep. */
kvc_status kvc_chunk_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv, int64_t len,
                            const float *const *scores, int32_t window, int64_t *keep_rows, int64_t *n_keep);

/* Top-k rows of one score vector: higher score first, then lower row; result sorted by row. */
void kvc_topk_rows(const float *scores, int64_t n, int64_t k, int64_t *out);

/* Check a press config (the messages kvc_session_set_press gives). */
kvc_status kvc_press_validate(const kvc_press_config *c);

/* The layer hook installed by kvc_session_set_press. */
kvc_status kvc_press_hook(void *user, struct kvc_session *s, const kvc_layer_ctx *ctx);
void kvc_press_free(kvc_press *p);

#endif
