/* The presses: scorer x allocation x selection x schedule (docs/METHODS.md), written once over the
 * backend interface. A press sees a session only through the door (core/press_i.h): the engine calls it
 * through its slot's vtable (kvc_press_slot_vt, kvc_decoding_slot_vt) and never names it. Internal API
 * between the files of this folder:
 *   session_press.c the attached press's kvc_session_* setters and diagnostics, its slot vtable
 *   config.c      defaults, the one validation of a press config (a scorer's own through its row), budget arithmetic
 *   params.c      the settings table: every setting by name (kvc_press_spec, the by-name setters, introspection)
 *   scorer.h/.c   the scorer interface: a row per scorer (name, code, trait bits, the settings it reads, its
 *                 check, its host function), registered by its own file; lookups by index and name
 *   scorers/      one file per scorer holding its row (and its host algorithm: KeyDiff, LagKV,
 *                 ExpectedAttention, NonCausalAttn, LeverageScore, CUR, Compactor, FINCH, SimLayerKV,
 *                 CapPress, DropKV); scorers/common.c the host helpers they share (RoPE undone, query
 *                 statistics, z-scores, the Gaussian sketch, Cholesky)
 *   score.c       a layer's scores: the backend's scorers, or a row's host function; the scorer checks
 *                 a backend would otherwise answer (window length, attention outputs, equal heads)
 *   observed.c    host algorithms: ObservedAttention's scores, Ada-KV's eviction loss
 *   allocation.c  how many rows each head keeps and which: uniform, PyramidKV, Ada-KV, layer totals
 *                 (TADA), ChunkKV's chunks; TADA's layer capacities from its statistics
 *   schedule.c    the post-prefill schedule (kvpress's): each layer compressed after its attention
 *   take.c        TAKE's chunked prefill with probes and delayed eviction (kvc_session_prefill_take)
 *   kvzip.c, kvgrad.c, kvcompose.c, restorekv.c, ea_stats.c  whole-cache methods over the door's probes
 *   decoding.c    compression while decoding (kvpress DecodingPress, CAMPress)
 *   merge.c       value merging on eviction (MergingPress, CAMPress) */
#ifndef KVC_PRESS_H
#define KVC_PRESS_H

#include "../core/press_i.h"
#include "part.h"
#include "scorer.h"

/* Per-session press state: config, recorded diagnostics and scratch. */
typedef struct kvc_press {
    kvc_press_config cfg;
    int32_t n_layers, n_kv;
    float **scores;        /* [L * Hkv] recorded scores (record_scores), or NULL */
    int64_t *score_len;    /* [L * Hkv] */
    double *error;         /* [L] eviction loss, NAN when not computed */
    /* layer-wise index reuse (ChunkKV): the rows the group's first layer kept */
    int64_t *reuse_rows;   /* [Hkv * reuse_len] */
    int64_t *reuse_n;      /* [Hkv] */
    int64_t reuse_len;     /* rows the heads held when the indices were chosen; 0: none */
    double *layer_seconds; /* [L] time spent scoring + selecting per layer */
    int64_t *layer_totals; /* [L] KVC_ALLOC_LAYER budgets (tokens over the layer's heads); -1 unset */
    double *e_internal;    /* [L] TADA: sum of the scores over heads and past rows */
    double *dissim;        /* [L] TADA: 1 - cos(R, R + O) averaged over the window tokens */
    const kvc_backend *be;
    kvc_buf *dev_scores;   /* the backend's score buffer, f32 [Hkv, dev_ld] */
    int64_t dev_ld;
    struct kvc_press *next; /* ComposedPress: the press that compresses this one's result next, or NULL */
    int32_t chained;        /* a member of a chain (ComposedPress) */
    int32_t n_heads, head_dim;
    void *parts[KVC_MAX_PARTS]; /* the state of each part it uses (part.h), by the part's index; NULL: unused */
} kvc_press;

/* The size of a caller's array, as the public ABI passes it: n values where `want` are read or written. */
static inline kvc_status kvc_check_size(const char *what, int64_t n, int64_t want) {
    return n == want ? KVC_OK
                     : kvc_fail(KVC_ERR_ARG, "%s: the array holds %lld values, the call needs %lld", what, (long long)n,
                                (long long)want);
}

/* ---- config.c ---- */
/* Scorers that protect an observation window at the end of the cache. */
static inline int kvc_scorer_has_window(int32_t scorer) { return kvc_scorer_has(scorer, KVC_SCORER_WINDOW); }
/* kvpress's int(n (1 - ratio)), at least 1; tokens a head of n rows keeps at a layer (kvc_press_kept). */
int64_t kvc_n_kept_ratio(int64_t n, double compression_ratio);
int64_t kvc_layer_budget(const kvc_press_config *p, int32_t layer, int32_t n_layers, int64_t n);
/* The protected window of a config (0 for scorers without one). */
static inline int32_t kvc_press_window(const kvc_press_config *p) { return kvc_scorer_has_window(p->scorer) ? p->window : 0; }
/* The query rows a config's scorer reads at the end of the call: 1 for TOVA's last query, else its window. */
static inline int32_t kvc_scorer_query_rows(const kvc_press_config *p) {
    return kvc_scorer_has(p->scorer, KVC_SCORER_LAST_QUERY) ? 1 : kvc_press_window(p);
}

/* ---- schedule.c ---- */
kvc_status kvc_press_new(const kvc_press_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_press **out);
void kvc_press_free(kvc_press *p);
/* The attached press's on_layer (its slot's vtable: kvc_press_slot_vt). */
kvc_status kvc_press_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx);
kvc_status kvc_press_recorded_scores(const kvc_press *p, int32_t layer, int32_t h, float *out, int64_t *n);
kvc_status kvc_press_set_layer_totals(kvc_press *p, const int64_t *totals, int32_t n_layers);
/* A checked copy of given query statistics (mean [L, H, d], cov [L, H, d, d], finite) into *m_slot, *c_slot,
 * replacing (freeing) what they held; on failure they are left as they were. */
kvc_status kvc_query_stats_set(int32_t L, int32_t H, int32_t d, const float *mean, const float *cov, int64_t n_mean,
                               int64_t n_cov, float **m_slot, float **c_slot);

/* ---- session_press.c ---- */
/* The slot of a press attached by kvc_session_set_press. */
extern const kvc_press_vt kvc_press_slot_vt;
/* The attached press (the first of a chain), or an error. */
kvc_status kvc_attached_press(const kvc_session *s, kvc_press **out);
/* The press the wrapper settings apply to: the last one of the chain (ComposedPress adds a member, then sets it). */
kvc_status kvc_last_press(const kvc_session *s, kvc_press **out);

/* ---- score.c ---- */
/* What the scoring of one layer reads: the backend, the model's dimensions, the layer's K/V. */
typedef struct kvc_layer_rows {
    const kvc_backend *be;
    const kvc_config *mc;
    kvc_kv *kv;
    const kvc_model *model; /* whose RoPE rule turns the rows (kvc_model_rope); NULL: mc's plain frequencies */
    kvc_view wo;           /* the layer's o_proj weight [D, H d] (CriticalKV); buf NULL without a model */
    const float *q_mean;   /* [H, d] given pre-RoPE query mean of this layer (ExpectedAttentionStats), or NULL */
    const float *q_cov;    /* [H, d, d] its covariance (with q_mean) */
    int64_t future_from;   /* ExpectedAttention's first future position; 0: the one after the call's last row */
} kvc_layer_rows;

/* The end of a call (its last row's position + 1): what the forward chose the call's RoPE by. */
static inline int64_t kvc_call_end(const kvc_layer_ctx *ctx) {
    return (ctx->pos ? ctx->pos[ctx->n - 1] : ctx->past_len[0] + ctx->n - 1) + 1;
}

/* The RoPE of layer `layer`'s rows as the forward turns them in a call ending at `end` (kvc_model_rope: LongRoPE's
 * factors and attention factor, Gemma 3's local base): the frequencies into freq[d/2] and the factor of the turned
 * pairs into *mscale. Without a model (press_compute on arrays): the config's plain frequencies and 1. */
kvc_status kvc_layer_rope(const kvc_layer_rows *lr, int32_t layer, int64_t end, float *freq, float *mscale);

/* The rows of a session's layer `l` with what the scorers need of its model; kv: the session's own K/V
 * store of that layer, or another store of the same layer (BlockPress's scratch). */
static inline kvc_layer_rows kvc_session_layer_rows(kvc_session *s, int32_t l, kvc_kv *kv) {
    const kvc_model *m = kvc_door_model(s);
    const kvc_layer_rows lr = {kvc_door_backend(s), &m->cfg, kv ? kv : kvc_door_cache(s)->layers[l].kv,
                               m, m->layers[l].wo, NULL, NULL, 0};
    return lr;
}

/* The rows of a session's layer as its press scores them: with the press's given query statistics
 * (ExpectedAttentionStatsPress's part, ea_stats.c). */
kvc_layer_rows kvc_press_layer_rows_of(const kvc_press *p, kvc_session *s, int32_t l);

/* A layer's scores for every head's first len[h] rows: the window is the last `window` queries of ctx
 * (kvc_score_args). Computed by the backend into *buf (grown as needed; f32 [Hkv, *ld]) and copied to
 * host[h] (len[h] each); a host scorer (KVC_SCORER_HOST) by its row's host function, then uploaded. */
kvc_status kvc_score_layer(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                           int32_t window, const int64_t *len, kvc_buf **buf, int64_t *ld, float *const *host);
/* The score buffer of a backend for Hkv rows of maxlen. */
kvc_status kvc_score_buffer(const kvc_backend *be, int32_t Hkv, kvc_buf **buf, int64_t *ld, int64_t maxlen);
/* Scores and the rows each head keeps for one layer of len[h] rows (no reuse, no statistics): what the
 * schedule and kvc_press_compute both do. */
kvc_status kvc_press_score_select(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, int64_t layer_total, kvc_buf **buf, int64_t *ld,
                                  float *const *scores, int64_t *const *keep, int64_t *n_keep);

/* ---- observed.c: on the host, from the layer's rows and queries brought there ---- */
/* Every head's first len[h] rows (K, and V when want_v) as host fp32 arrays in one allocation *block
 * (kvc_free it). */
kvc_status kvc_press_layer_rows(const kvc_layer_rows *lr, const int64_t *len, int want_v, float **k, float **v,
                                float **block);
kvc_status kvc_observed_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const int64_t *len,
                               float *const *scores);
/* Ada-KV's eviction loss: the window queries' attention output with all rows vs with the kept rows (L1,
 * mean over queries and heads). */
kvc_status kvc_eviction_error(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const int64_t *len, int32_t w,
                              const int64_t *const *keep, const int64_t *n_keep, double *out);

/* Presses that act with neither a compression_ratio nor a budget. */
static inline int kvc_press_decides_own_budget(const kvc_press_config *cfg) {
    return kvc_scorer_has(cfg->scorer, KVC_SCORER_OWN_BUDGET);
}
/* ---- scorers/common.c ---- */
/* sum [H, d] += x, outer [H, d, d] (lower triangle) += x x^T over this call's queries i >= n_sink, RoPE undone
 * (the pre-RoPE queries ExpectedAttention's statistics are made of; kvc_session_query_moments). */
kvc_status kvc_query_moments(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_sink, double *sum, double *outer);

/* ---- critical.c: CriticalKV / CriticalAdaKV's two stages over host scores (rewritten in place) ---- */
kvc_status kvc_critical_select(const kvc_layer_rows *lr, const kvc_press_config *cfg, int32_t layer, int32_t n_layers,
                               const int64_t *len, int32_t window, int64_t layer_total, float *const *scores,
                               int64_t *const *keep, int64_t *n_keep);

/* W_o^T [H d, D] of the layer (lr->wo) on the host as fp32, through the backend's matmul. */
kvc_status kvc_wo_transposed(const kvc_layer_rows *lr, float *wt);

/* ---- entropy_chunk.c: EntropyGatedChunkKV's selection, one for the layer's heads (keep_rows sorted) ---- */
kvc_status kvc_entropy_chunk_select(const kvc_press_config *p, int32_t n_kv, int64_t n, int64_t budget,
                                    const float *const *scores, int64_t *keep_rows, int64_t *n_keep);

/* ---- chunk_press.c: kvpress ChunkPress (FINCH's per-chunk selection) ---- */
/* Scorers ChunkPress runs as kvpress does on a chunk alone: those that read only its rows, and the window
 * scorers (their queries: the chunk's last rows at the prompt's last positions, kvpress's). */
static inline int kvc_chunk_press_scorer(int32_t scorer) { return kvc_scorer_has(scorer, KVC_SCORER_CHUNKABLE); }
/* Every chunk of cfg->chunk_press rows scored alone (a scratch K/V store of its rows), its own top
 * max(1, int(rows (1 - ratio))) kept; scores[h] receives the chunks' scores side by side. */
kvc_status kvc_chunk_press_select(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, kvc_buf **buf, int64_t *ld, float *const *scores,
                                  int64_t *const *keep, int64_t *n_keep);
/* Per-chunk selection (ChunkPress, FinchPress's chunk_length): every head's rows cut into chunks of `chunk`,
 * each keeping its top max(1, int(rows (1 - ratio))) of scores[h] (ties: the lower row); keep[h] sorted. */
kvc_status kvc_chunk_topk(int32_t Hkv, const int64_t *len, int64_t chunk, double ratio, const float *const *scores,
                          int64_t *const *keep, int64_t *n_keep);

/* ---- allocation.c ---- */
/* Rows to keep per head for this layer from host scores (uniform, pyramid, Ada-KV, layer totals, ChunkKV):
 * keep[h] receives them sorted, n_keep[h] their count. len[h]: rows per head; window: the protected
 * rows at the end of every head; layer_total: KVC_ALLOC_LAYER's budget. */
kvc_status kvc_press_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv,
                            const int64_t *len, const float *const *scores, int32_t window, int64_t layer_total,
                            int64_t *const *keep, int64_t *n_keep);
/* Whether a config selects each head's own top k (the backend's top-k kernel can do it). */
int kvc_press_per_head_topk(const kvc_press_config *p);

/* ---- lukv.c: LUKVPress (per-head keep counts from a budget curve) ---- */
/* LU-KV's keep counts of Hkv heads of n rows from their prune ratios: floor of the ideal counts, the rest of the
 * rounded total to the largest fractions (ties: the lower head), each in [1, n]. */
void kvc_lukv_counts(const float *prune, int32_t Hkv, int64_t n, int64_t *out);

/* ---- merge.c: value merging on eviction (MergingPress, CAMPress; the array functions are in kvpress_c.h) ---- */
/* MergingPress on the layer's rows before their compaction: the merged values of the kept rows written back. */
/* Every head's merged kept values written back in one batched write (the rows a merge changed), for MergingPress
 * and CAMPress: out[h] n_keep[h] rows of d, v[h] head h's values as read (row keep[h][i] before the merge). */
kvc_status kvc_merge_write_back(const kvc_layer_rows *lr, const int64_t *const *keep, const int64_t *n_keep,
                                const float *const *out, const float *const *v);
kvc_status kvc_press_merge(const kvc_layer_rows *lr, const kvc_press_config *cfg, const int64_t *len,
                           const int64_t *const *keep, const int64_t *n_keep);

/* ---- dms.c: DMSPress (threshold eviction behind a sliding window) ---- */
/* The decoding part's state: each layer's unjudged scores, continued from the prefill press's. */
typedef struct kvc_dms kvc_dms;
kvc_status kvc_dms_new(const kvc_press_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_dms **out);
void kvc_dms_free(kvc_dms *d);
void kvc_dms_reset(kvc_dms *d);
/* After the attention of a layer in a call after the session's first. */
kvc_status kvc_dms_decode(kvc_dms *d, kvc_session *s, const kvc_layer_ctx *ctx);

/* ---- decoding.c: compression while decoding (kvc_decoding_config; kvc_session_set_decoding_press) ---- */
typedef struct kvc_decoding kvc_decoding;
/* The slot of a decoding press: on_decode_layer, eager decode steps. */
extern const kvc_press_vt kvc_decoding_slot_vt;
kvc_status kvc_decoding_new(const kvc_decoding_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_decoding **out);
void kvc_decoding_free(kvc_decoding *d);
/* Counters and buffers back to the start (a session reset). */
void kvc_decoding_reset(kvc_decoding *d);
int64_t kvc_decoding_count(const kvc_decoding *d);
/* ExpectedAttentionStatsPress as a decoding press's base: its given statistics instead of the buffered queries'. */
kvc_status kvc_decoding_set_query_stats(kvc_decoding *d, const float *mean, const float *cov, int64_t n_mean,
                                        int64_t n_cov, int32_t H, int32_t hd);
/* After the attention of layer ctx->layer in a forward call that is not the session's first. */
kvc_status kvc_decoding_hook(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx);

/* ---- take.c ---- */
kvc_status kvc_take_prefill(kvc_session *s, const int32_t *ids, int64_t n, const kvc_take_config *cfg, float *logits);

/* ---- kvzip.c ---- */
kvc_status kvc_kvzip_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                           int32_t n_sink, int32_t plus, float *scores);
/* The int(L Hkv n ratio) lowest of scores [L, Hkv, n] over every layer and head (layerwise: int(Hkv n ratio) of
 * each layer) evicted, ties the lower index first, the first n_sink rows of each head ranked above everything;
 * every head of every layer holds the same rows, the first n scored, the rest (RestoreKV's restore rows) kept;
 * ratio in [0, 1]. */
kvc_status kvc_evict_lowest(kvc_session *s, const float *scores, int64_t n, double ratio, int32_t layerwise, int32_t n_sink);
/* The same after KVzip's scoring: the session must hold the full cache of its n_ctx context rows (and any rows after). */
kvc_status kvc_kvzip_evict(kvc_session *s, const float *scores, int64_t n_ctx, double ratio, int32_t layerwise,
                           int32_t n_sink);
/* KVzip's score of the chunk rows [start, end) from q reconstruction queries qh [q, H d] on one layer's rows k[h]
 * (the context's n_ctx rows, then the reconstruction rows): out[h, r - start] = the most, over the queries i and
 * the query heads hq of h's group, of softmax_j(qh_i k_j / sqrt(d))[r] x row_w[i] x col_w[hq, r - start] (softmax
 * over the min(n_sink, start) sinks, the chunk and the reconstruction rows <= i; NULL weights: 1). KVgrad's too. */
kvc_status kvc_kvzip_chunk_max(const kvc_config *c, const float *qh, int64_t q, float *const *k, int64_t n_ctx,
                               int64_t start, int64_t end, int32_t n_sink, const double *row_w, const double *col_w,
                               float *out);
/* ||v_r W_o[:, hq]||_2 of the rows [start, end) of v[h] for every query head hq: wov[hq (end - start) + r - start];
 * wt = W_o^T [H d, D] on the host. */
kvc_status kvc_kvzip_wov_norms(const kvc_config *c, const float *wt, float *const *v, int64_t start, int64_t end,
                               double *wov);

/* ---- kvgrad.c ---- */
kvc_status kvc_kvgrad_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                            int32_t n_sink, float *scores, float *grad_norms);

/* ---- restorekv.c ---- */
kvc_status kvc_append_embeddings(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora);

#endif
