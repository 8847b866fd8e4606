/* A press's settings as the C core holds them: the struct behind kvc_press_spec (params.c: every field is a row
 * of the settings table, set by name) and behind a decoding press's kvc_decoding_config. Internal: no struct of
 * settings crosses the public ABI, so a new setting renumbers nothing a client compiled against. */
#ifndef KVC_PRESS_CONFIG_H
#define KVC_PRESS_CONFIG_H

#include "../include/kvpress_c.h"

typedef enum kvc_allocation {
    KVC_ALLOC_UNIFORM = 0,   /* same budget for every head */
    KVC_ALLOC_PYRAMID = 1,   /* PyramidKV layer schedule (kvpress integer schedule) */
    KVC_ALLOC_ADAKV = 2,     /* Ada-KV head-wise budgets */
    KVC_ALLOC_LAYER = 3      /* given per-layer totals (TADA), chosen across the layer's heads */
} kvc_allocation;

typedef enum kvc_safeguard {
    KVC_SAFEGUARD_FLOOR = 0,   /* official Ada-KV code: cap_h = round(f_h (1 - a) + floor(Bp a)) */
    KVC_SAFEGUARD_PROTECT = 1  /* kvpress AdaKVPress: each head's top int(n_kept a) protected */
} kvc_safeguard;

typedef struct kvc_press_config {
    int32_t scorer;            /* the scorer's index (set it by name: kvc_press_config_set_str) */
    int32_t allocation;        /* kvc_allocation */
    double compression_ratio;  /* fraction removed, in [0, 1); used when budget == 0 */
    int64_t budget;            /* tokens kept per KV head per layer on average (window inside); 0: ratio */
    int32_t window;            /* observation window w (SnapKV-family scorers; 0 for others) */
    int32_t kernel;            /* pooling kernel (odd, >= 1; 1 = no pooling) */
    int32_t pool_max;          /* 0: average pooling (counts padding, like torch avg_pool1d); 1: max */
    int32_t gqa_max;           /* 0: mean over the heads of a group; 1: max */
    int32_t pool_then_reduce;  /* 1: pool per query head then reduce (kvpress); 0: reduce first (Ada-KV code) */
    int32_t n_sink;            /* StreamingLLM sinks */
    uint64_t seed;             /* RandomPress */
    float alpha_safeguard;     /* Ada-KV */
    int32_t safeguard;         /* kvc_safeguard */
    int32_t pyramid_beta;      /* PyramidKV beta (20) */
    int32_t record_scores;     /* keep each layer's scores for kvc_session_press_scores */
    int32_t chunk_length;      /* ChunkKV: select chunks of this many tokens (0: single tokens) */
    int32_t reuse_layers;      /* ChunkKV layer-wise index reuse: groups of this many layers (<= 1: off) */
    float edie_alpha;          /* EDIE: U = a / (1 + alpha - a) * (|v|_1 + |o|_1) */
    int32_t drop_window;       /* the window rows are scoring queries only (Judge Q soft tokens, an
                                  answer for the oracle): they are evicted, the budget is over the rest */
    /* ---- kvpress's scorers (n_sink above is theirs too: LagKV, ExpectedAttention) ---- */
    int32_t lag_size;          /* LagKV partition length (128) */
    int32_t cross_scoring;     /* LagKV: 1 keeps the raw partition scores (comparable across partitions) */
    int32_t n_future;          /* ExpectedAttention n_future_positions (512) */
    int32_t use_covariance;    /* ExpectedAttention: add k^T Cov k / 2d (1) */
    int32_t use_vnorm;         /* ExpectedAttention: (score + epsilon) * ||v|| (1) */
    float epsilon;             /* ExpectedAttention (0) */
    int32_t critical;          /* CriticalKV two-stage selection over the scorer (with KVC_ALLOC_ADAKV: CriticalAdaKV) */
    float critical_eps;        /* CriticalKV: (score + eps) * |W_o v|_1 (1e-4) */
    float first_stage_ratio;   /* CriticalKV: share of the budget chosen on the plain scores (0.5) */
    int32_t attn_chunk;        /* NonCausalAttn chunk_size (256) */
    int32_t sketch_dim;        /* LeverageScore sketch_dimension (48); its sketch is drawn from `seed` */
    int32_t cur_type;          /* CUR leverage_type: 0 key, 1 value, 2 kv_avg, 3 kv_product (3) */
    int32_t cur_random;        /* CUR use_random_leverage: K and V times a [d, 20] sketch from `seed` (0) */
    int32_t cur_window;        /* CUR local_window_size (16); 0: use_local_approximation off */
    int32_t cmp_sink_start;    /* Compactor sink_size_start (8): first rows kept (scored the maximum) */
    int32_t cmp_sink_end;      /* Compactor sink_size_end (4): last rows kept */
    float cmp_blend;           /* Compactor blending: blend x leverage + non-causal attention */
    /* ---- kvpress's wrappers that change the selection ---- */
    int32_t chunk_press;       /* ChunkPress chunk_length: each chunk scored alone, its own top share (0: off) */
    int32_t finch_normalize;   /* FinchPress normalize_scores: window query j's attention times len - w + j (1) */
    int32_t finch_chunk;       /* FinchPress chunk_length: the layer's scores cut in chunks, each its top share (0: off) */
    float lazy_threshold;      /* SimLayerKV: a layer is lazy when its attention mass on the kept rows exceeds this (1) */
    int32_t n_recent;          /* SimLayerKV: recent rows a lazy layer keeps, the window's included (1024) */
    int32_t low_entropy_chunk; /* EntropyGatedChunkKV (with chunk_length): tokens a high-score, low-entropy chunk
                                  keeps (0: plain ChunkKV) */
    /* ---- value merging on eviction (csrc/press/merge.c) ---- */
    int32_t merge;             /* MergingPress: each evicted row's value folded into its most key-similar kept row */
    float merge_threshold;     /* MergingPress similarity_threshold: least cosine similarity of a merge (0) */
    float merge_fraction;      /* MergingPress merge_fraction: share of the evicted rows (by similarity) merged (1) */
    /* ---- CapPress (n_sink, n_future and epsilon above are its too) ---- */
    float cap_tau;             /* CapPress tau: the temperature of the query-key alignment weights (5) */
    /* ---- DMSPress: threshold eviction behind a sliding window (csrc/press/dms.c) ---- */
    int32_t dms;               /* 1: rows leaving the window that score below dms_threshold are evicted (no ratio) */
    float dms_threshold;       /* DMSPress threshold */
    int32_t dms_window;        /* DMSPress sliding_window_size: the last rows, never judged yet (128) */
    /* ---- a scorer the caller gives (scorers "callback", "callback_window", "callback_stats", "callback_select";
     *      kvc_scorer_view in kvpress_c.h; scorers/callback.c). Set by name like every setting: an address is a number. */
    uint64_t callback;         /* the kvc_scorer_callback's address */
    uint64_t callback_user;    /* the user pointer it receives */
    int32_t callback_needs;    /* KVC_VIEW_* bits: what its view carries beyond the keys */
} kvc_press_config;

typedef struct kvc_decoding_config {
    kvc_press_config base;            /* scorer, allocation, chunks of each compression (its ratio/budget unused) */
    int64_t compression_interval;     /* steps between compressions (512) */
    int64_t target_size;              /* rows kept per KV head by a compression (2048) */
    int32_t ratio_target;             /* 1: CompressionRatioDecodingPress, target = max(1, int(tokens seen x (1 - r))) */
    double target_compression_ratio;  /* r in [0, 1) (0.5) */
    int32_t hidden_states_buffer_size;/* steps whose queries stay buffered between compressions (256) */
    int32_t cam_merge_budget;         /* CAMPress merge_budget (> 0: CaM's merge before pruning; 0: DecodingPress) */
    uint64_t cam_seed;                /* CAMPress: the stream of its Bernoulli merge draws (docs/METHODS.md) */
} kvc_decoding_config;

/* ---- config.c ---- */
/* kvpress's defaults (SnapKV w=64, k=5, avg, mean, pool then reduce, ratio 0). */
void kvc_press_config_defaults(kvc_press_config *cfg);
/* The one validation of a press config (every attach, compute and spec check runs it): KVC_ERR_ARG with the
 * message. Giving both compression_ratio and budget is refused. */
kvc_status kvc_press_config_check(const kvc_press_config *cfg);
/* Tokens a head of `n` rows keeps at `layer` of `n_layers` (uniform: min(n, budget) or kvpress's
 * max(1, int(n (1 - ratio))); PyramidKV: the layer's share of its schedule). */
kvc_status kvc_press_kept(const kvc_press_config *cfg, int32_t layer, int32_t n_layers, int64_t n, int64_t *out);

/* ---- params.c: settings by name on a config ---- */
kvc_status kvc_press_config_set_i64(kvc_press_config *c, const char *name, int64_t value);
kvc_status kvc_press_config_set_u64(kvc_press_config *c, const char *name, uint64_t value);
kvc_status kvc_press_config_set_f64(kvc_press_config *c, const char *name, double value);
kvc_status kvc_press_config_set_str(kvc_press_config *c, const char *name, const char *value);
kvc_status kvc_press_config_get(const kvc_press_config *c, const char *name, double *value);
/* The config a spec holds (the engine's internal form). */
const kvc_press_config *kvc_press_spec_config(const kvc_press_spec *p);

/* ---- session_press.c ---- */
/* Attach (NULL detaches) / chain a press of this config (kvc_session_attach_press, kvc_session_chain_press). */
kvc_status kvc_session_set_press(kvc_session *s, const kvc_press_config *cfg);
kvc_status kvc_session_add_press(kvc_session *s, const kvc_press_config *cfg);

/* ---- compute.c: the press on arrays on a device (kvc_press_spec_compute) ---- */
kvc_status kvc_device_press_compute(int32_t device, const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d,
                                    int32_t layer, int32_t n_layers, const float *q, const float *attn, int64_t n,
                                    const float *k, const float *v, int64_t len, int64_t layer_total, float *scores,
                                    int64_t *keep, int64_t *n_keep);

/* ---- decoding.c ---- */
void kvc_decoding_config_defaults(kvc_decoding_config *cfg);

#endif
