/* What several host scorers share (docs/METHODS.md, "kvpress scorers"): RoPE undone and averaged, the
 * call's query statistics, z-scores, the Gaussian sketch, a Cholesky factor. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"
#include "../../core/rng.h"

#define Q_TILE 128

kvc_status kvc_layer_freqs(const kvc_layer_rows *lr, int32_t layer, int64_t end, double *freq, double *mscale) {
    float f[128], ms;
    KVC_TRY(kvc_layer_rope(lr, layer, end, f, &ms));
    for (int32_t j = 0; j < lr->mc->head_dim / 2; j++) freq[j] = f[j];
    *mscale = ms;
    return KVC_OK;
}

void kvc_unrope(int32_t pairing, int32_t d, const double *freq, double mscale, double pos, const float *x, double *out) {
    for (int32_t j = 0; j < d / 2; j++) {
        int32_t a, b;
        kvc_rope_pair(pairing, d, j, &a, &b);
        const double cs = cos(pos * freq[j]), sn = sin(pos * freq[j]), inv = freq[j] != 0 ? 1.0 / mscale : 1.0;
        out[a] = (x[a] * cs + x[b] * sn) * inv; /* the inverse rotation */
        out[b] = (-x[a] * sn + x[b] * cs) * inv;
    }
}

/* sum [H, d] += x and outer [H, d, d] (lower triangle; NULL: none) += x x^T over this call's queries i >= n_sink
 * with RoPE undone (x: pre-RoPE). ExpectedAttention's statistics of a call and kvc_query_moments' over a corpus. */
static kvc_status query_sums(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_sink, double *mu, double *cov) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, d = c->head_dim;
    const int64_t qd = (int64_t)H * d;
    double freq[128], ms;
    KVC_TRY(kvc_layer_freqs(lr, ctx->layer, kvc_call_end(ctx), freq, &ms));
    float *qt = malloc(sizeof(float) * Q_TILE * (size_t)qd);
    double *u = malloc(sizeof(double) * Q_TILE * (size_t)qd);
    kvc_status st = qt && u ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: query statistics");
    for (int64_t i0 = n_sink; i0 < ctx->n && st == KVC_OK; i0 += Q_TILE) {
        const int64_t t = ctx->n - i0 < Q_TILE ? ctx->n - i0 : Q_TILE;
        st = lr->be->download(kvc_view_at(ctx->q, i0, 0), t, qd, qt, KVC_F32);
        if (st != KVC_OK) break;
        for (int64_t i = 0; i < t; i++) {
            const double pos = (double)(ctx->pos ? ctx->pos[i0 + i] : ctx->past_len[0] + i0 + i);
            for (int32_t h = 0; h < H; h++)
                kvc_unrope(c->rope_pairing, d, freq, ms, pos, qt + i * qd + (int64_t)h * d, u + i * qd + (int64_t)h * d);
        }
#pragma omp parallel for schedule(static)
        for (int32_t h = 0; h < H; h++)
            for (int64_t i = 0; i < t; i++) {
                const double *x = u + i * qd + (int64_t)h * d;
                for (int32_t a = 0; a < d; a++) {
                    mu[(int64_t)h * d + a] += x[a];
                    if (!cov) continue;
                    double *row = cov + ((int64_t)h * d + a) * d;
                    for (int32_t b = 0; b <= a; b++) row[b] += x[a] * x[b];
                }
            }
    }
    free(qt);
    free(u);
    return st;
}

kvc_status kvc_query_moments(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_sink, double *sum, double *outer) {
    return query_sums(lr, ctx, n_sink, sum, outer);
}

/* mu [H, d] and the biased cov [H, d, d] (NULL: no covariance) of this call's queries i >= n_sink, RoPE undone. */
kvc_status kvc_query_stats(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_sink, double *mu, double *cov) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, m = ctx->n - n_sink;
    memset(mu, 0, sizeof(double) * (size_t)qd);
    if (cov) memset(cov, 0, sizeof(double) * (size_t)qd * d);
    KVC_TRY(query_sums(lr, ctx, n_sink, mu, cov));
    for (int64_t i = 0; i < qd; i++) mu[i] /= (double)m;
    for (int32_t h = 0; cov && h < H; h++) {
        const double *mh = mu + (int64_t)h * d;
        double *ch = cov + (int64_t)h * d * d;
        for (int32_t a = 0; a < d; a++)
            for (int32_t b = 0; b <= a; b++) ch[a * d + b] = ch[b * d + a] = ch[a * d + b] / (double)m - mh[a] * mh[b];
    }
    return KVC_OK;
}

/* x <- R x for the average rotation R of pairs (cbar_j, sbar_j), on one vector of d with stride. */
void kvc_avg_rotate(int32_t pairing, int32_t d, const double *cb, const double *sb, double *x, int64_t stride) {
    for (int32_t j = 0; j < d / 2; j++) {
        int32_t a, b;
        kvc_rope_pair(pairing, d, j, &a, &b);
        const double xa = x[a * stride], xb = x[b * stride];
        x[a * stride] = cb[j] * xa - sb[j] * xb;
        x[b * stride] = sb[j] * xa + cb[j] * xb;
    }
}

/* RoPE averaged over the n_future positions that follow this call's last query, as kvpress averages it
 * (ExpectedAttention, CapPress: transformers' cos, sin of those positions, so LongRoPE's rule at their end and its
 * attention factor): cb[j], sb[j] = the mean cos, sin of pair j's angle, times the factor where the pair turns. */
kvc_status kvc_future_rope(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_future, double *cb, double *sb) {
    const int32_t half = lr->mc->head_dim / 2;
    const int64_t next = lr->future_from > 0 ? lr->future_from : kvc_call_end(ctx);
    double freq[128], ms;
    KVC_TRY(kvc_layer_freqs(lr, ctx->layer, next + n_future, freq, &ms));
    for (int32_t j = 0; j < half; j++) {
        double cs = 0, sn = 0;
        for (int32_t t = 0; t < n_future; t++) {
            cs += cos((double)(next + t) * freq[j]);
            sn += sin((double)(next + t) * freq[j]);
        }
        const double f = freq[j] != 0 ? ms : 1.0;
        cb[j] = f * cs / n_future;
        sb[j] = f * sn / n_future;
    }
    return KVC_OK;
}

/* Whether the layer holds exactly this call's rows (a prefill with no past): what the prefill-only scorers need. */
int kvc_plain_prefill(const kvc_layer_ctx *ctx, const int64_t *len, int32_t Hkv) {
    for (int32_t h = 0; h < Hkv; h++)
        if (ctx->past_len[h] != 0 || len[h] != ctx->n) return 0;
    return 1;
}

/* scores[h][r0 + r] = the z-score of acc[h n + r] over every head and row (torch's unbiased std, at least
 * 1e-6): NonCausalAttn's and LeverageScore's last step */
void kvc_zscore(const double *acc, int32_t Hkv, int64_t n, int64_t r0, float *const *scores) {
    const double cnt = (double)Hkv * (double)n;
    double mean = 0, ss = 0;
    for (int64_t i = 0; i < (int64_t)Hkv * n; i++) mean += acc[i];
    mean /= cnt;
    for (int64_t i = 0; i < (int64_t)Hkv * n; i++) ss += (acc[i] - mean) * (acc[i] - mean);
    const double sd = fmax(cnt > 1 ? sqrt(ss / (cnt - 1)) : 0.0, 1e-6);
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < n; r++) scores[h][r0 + r] = (float)((acc[(size_t)h * n + r] - mean) / sd);
}

/* The Gaussian sketch of a layer, count values N(0, 1) as float: splitmix64 (core/rng.h) from the state
 * seed + (layer + 1) * 0x9E3779B97F4A7C15, pairs by Box-Muller (u1 = (x1 >> 11 + 1) 2^-53, u2 = (x2 >> 11) 2^-53,
 * r = sqrt(-2 ln u1): r cos(2 pi u2), r sin(2 pi u2)). tests/reference/kvpress_scorers_reference.py has the same. */
void kvc_gaussian_sketch(uint64_t seed, int32_t layer, int64_t count, float *out) {
    uint64_t s = seed + (uint64_t)(layer + 1) * 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < count; i += 2) {
        const double u1 = (double)((kvc_splitmix64_next(&s) >> 11) + 1) * 0x1p-53, u2 = (double)(kvc_splitmix64_next(&s) >> 11) * 0x1p-53;
        const double r = sqrt(-2.0 * log(u1)), a = 2.0 * M_PI * u2;
        out[i] = (float)(r * cos(a));
        if (i + 1 < count) out[i + 1] = (float)(r * sin(a));
    }
}

/* Lower Cholesky factor of the k x k matrix a (in place); 0 when not positive definite. */
int kvc_cholesky(double *a, int32_t k) {
    for (int32_t j = 0; j < k; j++) {
        double dj = a[j * k + j];
        for (int32_t t = 0; t < j; t++) dj -= a[j * k + t] * a[j * k + t];
        if (!(dj > 0)) return 0;
        dj = sqrt(dj);
        a[j * k + j] = dj;
        for (int32_t i = j + 1; i < k; i++) {
            double v = a[i * k + j];
            for (int32_t t = 0; t < j; t++) v -= a[i * k + t] * a[j * k + t];
            a[i * k + j] = v / dj;
        }
    }
    return 1;
}
