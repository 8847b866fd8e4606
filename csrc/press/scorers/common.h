/* What the scorer files share: the press internals (../press.h), the row interface (../scorer.h), and the
 * host helpers of common.c that several host scorers use. */
#ifndef KVC_SCORERS_COMMON_H
#define KVC_SCORERS_COMMON_H

#include "../press.h"

/* RoPE's pair j of a head of d: dimensions (a, b). */
static inline void kvc_rope_pair(int32_t pairing, int32_t d, int32_t j, int32_t *a, int32_t *b) {
    if (pairing == KVC_ROPE_HALF) {
        *a = j;
        *b = j + d / 2;
    } else {
        *a = 2 * j;
        *b = 2 * j + 1;
    }
}

/* kvc_layer_rope in double: the frequencies of RoPE's pairs and the attention factor of the turned ones, as the
 * forward turned layer `layer`'s rows in a call ending at `end`. */
kvc_status kvc_layer_freqs(const kvc_layer_rows *lr, int32_t layer, int64_t end, double *freq, double *mscale);
/* x [d] (one head's row at position pos, turned with freq and mscale) back to before RoPE. */
void kvc_unrope(int32_t pairing, int32_t d, const double *freq, double mscale, double pos, const float *x, double *out);
/* mu [H, d] and the biased cov [H, d, d] (NULL: no covariance) of this call's queries i >= n_sink, RoPE undone. */
kvc_status kvc_query_stats(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_sink, double *mu, double *cov);
/* x <- R x for the average rotation R of pairs (cbar_j, sbar_j), on one vector of d with stride. */
void kvc_avg_rotate(int32_t pairing, int32_t d, const double *cb, const double *sb, double *x, int64_t stride);
/* RoPE averaged over the n_future positions that follow this call's last query, the attention factor included
 * (ExpectedAttention, CapPress). */
kvc_status kvc_future_rope(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_future, double *cb, double *sb);
/* Whether the layer holds exactly this call's rows (a prefill with no past): what the prefill-only scorers need. */
int kvc_plain_prefill(const kvc_layer_ctx *ctx, const int64_t *len, int32_t Hkv);
/* scores[h][r0 + r] = the z-score of acc[h n + r] over every head and row (NonCausalAttn, LeverageScore). */
void kvc_zscore(const double *acc, int32_t Hkv, int64_t n, int64_t r0, float *const *scores);
/* A layer's Gaussian sketch of count N(0, 1) floats from seed (LeverageScore, CUR). */
void kvc_gaussian_sketch(uint64_t seed, int32_t layer, int64_t count, float *out);
/* Lower Cholesky factor of the k x k matrix a (in place); 0 when not positive definite. */
int kvc_cholesky(double *a, int32_t k);

/* noncausal.c, leverage.c: the z-scores of the prefill's rows [r0, r0 + n) alone (Compactor scores a middle slice). */
kvc_status kvc_noncausal_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                               const int64_t *len, int64_t r0, int64_t n, float *const *scores);
kvc_status kvc_leverage_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                              const int64_t *len, int64_t r0, int64_t n, float *const *scores);

/* finch.c: the window queries' attention on the rows before them (FinchPress; SimLayerKV with normalize 0). */
kvc_status kvc_finch_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                            const int64_t *len, int normalize, float *const *scores);

#endif
