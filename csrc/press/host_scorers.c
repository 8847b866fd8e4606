/* kvpress's scorers that run on the host, whatever the device (docs/METHODS.md, "kvpress
 * scorers"): the layer's rows and this call's queries are brought to the host as fp32 (a memcpy on the
 * CPU backend), as ObservedAttention does (observed.c), and scored in double where a sum is long:
 *  - KeyDiff: -cos(k, anchor), anchor = mean over the head's rows of k / ||k||;
 *  - LagKV: rows after the n_sink sinks in partitions of lag_size; a partition's K and V are min-max
 *    normalised by the next partition's per-dimension range, the std over dimensions softmaxed over the
 *    partition, K and V averaged, then ranked inside the partition (rank / lag_size) unless
 *    cross_scoring; sinks and the last (reference-only) partition and the remainder score 1;
 *  - ExpectedAttention: the mean and covariance of this call's queries after the first n_sink, with
 *    RoPE undone, rotated by RoPE averaged over the next n_future positions; a key's score is the softmax
 *    over the non-sink rows of k.mu / sqrt(d) + k^T Cov k / 2d, averaged over the group, times ||v||
 *    (+ epsilon first); the sinks score the layer's maximum + 1;
 *  - NonCausalAttn (Compactor's attention term): a prefill's queries attend without a causal mask inside
 *    chunks of attn_chunk rows (logits q.k unscaled; the last chunk padded with zero rows as kvpress pads
 *    it: padded keys get logit -1e-9, padded queries logit 0 on the real keys), summed over the chunk's
 *    queries, averaged over the group, times ||v||, averaged over 3 rows (zeros outside, as avg_pool1d),
 *    then z-normalised over the whole layer (mean and unbiased std over every head and row);
 *  - CapPress (CAPKV): ExpectedAttention's rotated query mean as an anchor, alignment weights
 *    w = exp(tau cos(anchor, k)), a row's score w v^T (I + sum (w + eps) v v^T)^-1 v (cap_scores). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

#define Q_TILE 128

/* ---- KeyDiff ---- */

static void keydiff_head(const float *k, int64_t len, int32_t d, float *out) {
    double anchor[256] = {0};
    for (int64_t r = 0; r < len; r++) {
        double nrm = 0;
        for (int32_t i = 0; i < d; i++) nrm += (double)k[r * d + i] * k[r * d + i];
        nrm = fmax(sqrt(nrm), 1e-12); /* F.normalize's eps */
        for (int32_t i = 0; i < d; i++) anchor[i] += k[r * d + i] / nrm;
    }
    double an = 0;
    for (int32_t i = 0; i < d; i++) {
        anchor[i] /= (double)len;
        an += anchor[i] * anchor[i];
    }
    an = sqrt(an);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < len; r++) {
        double dot = 0, kn = 0;
        for (int32_t i = 0; i < d; i++) {
            dot += k[r * d + i] * anchor[i];
            kn += (double)k[r * d + i] * k[r * d + i];
        }
        out[r] = (float)(-dot / fmax(sqrt(kn) * an, 1e-8)); /* F.cosine_similarity's eps */
    }
}

/* ---- LagKV ---- */

/* Softmax over the lag rows of partition x of the std over dimensions of (x - min) / (max - min), the
 * range per dimension from partition ref (both [lag, d]); out[lag] accumulates half of it; sd: scratch [lag]. */
static void lag_states(const float *x, const float *ref, int64_t lag, int32_t d, double *sd, double *out) {
    double lo[256], hi[256];
    for (int32_t i = 0; i < d; i++) lo[i] = hi[i] = ref[i];
    for (int64_t r = 1; r < lag; r++)
        for (int32_t i = 0; i < d; i++) {
            lo[i] = fmin(lo[i], ref[r * d + i]);
            hi[i] = fmax(hi[i], ref[r * d + i]);
        }
    double mx = -INFINITY;
    for (int64_t r = 0; r < lag; r++) {
        double mean = 0, ss = 0;
        for (int32_t i = 0; i < d; i++) mean += (x[r * d + i] - lo[i]) / (hi[i] - lo[i]);
        mean /= d;
        for (int32_t i = 0; i < d; i++) {
            const double z = (x[r * d + i] - lo[i]) / (hi[i] - lo[i]) - mean;
            ss += z * z;
        }
        sd[r] = sqrt(ss / (d - 1)); /* torch's std: unbiased */
        mx = fmax(mx, sd[r]);
    }
    double sum = 0;
    for (int64_t r = 0; r < lag; r++) sum += (sd[r] = exp(sd[r] - mx));
    for (int64_t r = 0; r < lag; r++) out[r] += 0.5 * sd[r] / sum;
}

static kvc_status lagkv_head(const float *k, const float *v, int64_t n, int32_t d, int32_t n_sink, int64_t lag,
                             int32_t cross, float *out) {
    if (n < n_sink + 2 * lag) { /* too short for two partitions: a ramp after the sinks, as kvpress */
        for (int64_t r = 0; r < n; r++) out[r] = r < n_sink ? 1.0f : (float)((double)(r - n_sink) / (double)(n - n_sink));
        return KVC_OK;
    }
    const int64_t parts = (n - n_sink) / lag;
    double *s = malloc(sizeof(double) * (size_t)lag * 2);
    if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: LagKV scores");
    double *sd = s + lag;
    for (int64_t r = 0; r < n; r++) out[r] = 1.0f;
    for (int64_t p = 0; p < parts - 1; p++) {
        const int64_t r0 = n_sink + p * lag;
        memset(s, 0, sizeof(double) * (size_t)lag);
        lag_states(k + r0 * d, k + (r0 + lag) * d, lag, d, sd, s);
        lag_states(v + r0 * d, v + (r0 + lag) * d, lag, d, sd, s);
        if (cross) {
            for (int64_t r = 0; r < lag; r++) out[r0 + r] = (float)s[r];
            continue;
        }
        /* rank inside the partition (0 = lowest; equal scores by row), over lag_size */
        for (int64_t r = 0; r < lag; r++) {
            int64_t rank = 0;
            for (int64_t j = 0; j < lag; j++) rank += s[j] < s[r] || (s[j] == s[r] && j < r);
            out[r0 + r] = (float)((double)rank / (double)lag);
        }
    }
    free(s);
    return KVC_OK;
}

/* ---- ExpectedAttention ---- */

/* RoPE's pair j of a head of d: dimensions (a, b). */
static inline void rope_pair(int32_t pairing, int32_t d, int32_t j, int32_t *a, int32_t *b) {
    if (pairing == KVC_ROPE_HALF) {
        *a = j;
        *b = j + d / 2;
    } else {
        *a = 2 * j;
        *b = 2 * j + 1;
    }
}

/* The frequencies of RoPE's pairs for this layer's rows: the model's, or from the config (no model). */
static kvc_status layer_freqs(const kvc_layer_rows *lr, double *freq) {
    const int32_t half = lr->mc->head_dim / 2;
    if (lr->inv_freq) {
        for (int32_t j = 0; j < half; j++) freq[j] = lr->inv_freq[j];
        return KVC_OK;
    }
    float f[128];
    KVC_TRY(kvc_kernel_rope_freqs(lr->mc, f));
    for (int32_t j = 0; j < half; j++) freq[j] = f[j];
    return KVC_OK;
}

/* sum [H, d] += x and outer [H, d, d] (lower triangle; NULL: none) += x x^T over this call's queries i >= n_sink
 * with RoPE undone (x: pre-RoPE). ExpectedAttention's statistics of a call and kvc_query_moments' over a corpus. */
static kvc_status query_sums(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const double *freq, int32_t n_sink,
                             double *mu, double *cov) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, d = c->head_dim, half = d / 2;
    const int64_t qd = (int64_t)H * d;
    float *qt = malloc(sizeof(float) * Q_TILE * (size_t)qd);
    double *u = malloc(sizeof(double) * Q_TILE * (size_t)qd);
    kvc_status st = qt && u ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: query statistics");
    for (int64_t i0 = n_sink; i0 < ctx->n && st == KVC_OK; i0 += Q_TILE) {
        const int64_t t = ctx->n - i0 < Q_TILE ? ctx->n - i0 : Q_TILE;
        st = lr->be->download(kvc_view_at(ctx->q, i0, 0), t, qd, qt, KVC_F32);
        if (st != KVC_OK) break;
        for (int64_t i = 0; i < t; i++) {
            const double pos = (double)(ctx->pos ? ctx->pos[i0 + i] : ctx->past_len[0] + i0 + i);
            for (int32_t h = 0; h < H; h++) {
                const float *q = qt + i * qd + (int64_t)h * d;
                double *x = u + i * qd + (int64_t)h * d;
                for (int32_t j = 0; j < half; j++) {
                    int32_t a, b;
                    rope_pair(c->rope_pairing, d, j, &a, &b);
                    const double cs = cos(pos * freq[j]), sn = sin(pos * freq[j]);
                    x[a] = q[a] * cs + q[b] * sn; /* the inverse rotation */
                    x[b] = -q[a] * sn + q[b] * cs;
                }
            }
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
    double freq[128];
    KVC_TRY(layer_freqs(lr, freq));
    return query_sums(lr, ctx, freq, n_sink, sum, outer);
}

/* mu [H, d] and the biased cov [H, d, d] (NULL: no covariance) of this call's queries i >= n_sink, RoPE undone. */
static kvc_status query_stats(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const double *freq, int32_t n_sink,
                              double *mu, double *cov) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, m = ctx->n - n_sink;
    memset(mu, 0, sizeof(double) * (size_t)qd);
    if (cov) memset(cov, 0, sizeof(double) * (size_t)qd * d);
    KVC_TRY(query_sums(lr, ctx, freq, n_sink, mu, cov));
    for (int64_t i = 0; i < qd; i++) mu[i] /= (double)m;
    for (int32_t h = 0; cov && h < H; h++) {
        const double *mh = mu + (int64_t)h * d;
        double *ch = cov + (int64_t)h * d * d;
        for (int32_t a = 0; a < d; a++)
            for (int32_t b = 0; b <= a; b++) ch[a * d + b] = ch[b * d + a] = ch[a * d + b] / (double)m - mh[a] * mh[b];
    }
    return KVC_OK;
}

/* ExpectedAttentionStats: mu and cov of query head layout [H, d], [H, d, d] from the statistics the press was
 * given (pre-RoPE, the model's channel order) instead of this call's queries. */
static void given_stats(const kvc_layer_rows *lr, double *mu, double *cov) {
    const int64_t qd = (int64_t)lr->mc->n_heads * lr->mc->head_dim;
    for (int64_t i = 0; i < qd; i++) mu[i] = lr->q_mean[i];
    for (int64_t i = 0; cov && i < qd * lr->mc->head_dim; i++) cov[i] = lr->q_cov[i];
}

/* x <- R x for the average rotation R of pairs (cbar_j, sbar_j), on one vector of d with stride. */
static void avg_rotate(int32_t pairing, int32_t d, const double *cb, const double *sb, double *x, int64_t stride) {
    for (int32_t j = 0; j < d / 2; j++) {
        int32_t a, b;
        rope_pair(pairing, d, j, &a, &b);
        const double xa = x[a * stride], xb = x[b * stride];
        x[a * stride] = cb[j] * xa - sb[j] * xb;
        x[b * stride] = sb[j] * xa + cb[j] * xb;
    }
}

/* RoPE averaged over the n_future positions that follow this call's last query, as kvpress averages it
 * (ExpectedAttention, CapPress): cb[j], sb[j] = the mean cos, sin of pair j's angle; freq[j] its frequency. */
static kvc_status future_rope(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t n_future, double *freq, double *cb,
                              double *sb) {
    const int32_t half = lr->mc->head_dim / 2;
    KVC_TRY(layer_freqs(lr, freq));
    const int64_t next = lr->future_from > 0 ? lr->future_from
                                              : (ctx->pos ? ctx->pos[ctx->n - 1] : ctx->past_len[0] + ctx->n - 1) + 1;
    for (int32_t j = 0; j < half; j++) {
        double cs = 0, sn = 0;
        for (int32_t t = 0; t < n_future; t++) {
            cs += cos((double)(next + t) * freq[j]);
            sn += sin((double)(next + t) * freq[j]);
        }
        cb[j] = cs / n_future;
        sb[j] = sn / n_future;
    }
    return KVC_OK;
}

static kvc_status expected_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, ns = cfg->n_sink;
    if (ctx->n <= ns && !lr->q_mean) /* given statistics need no queries */
        return kvc_fail(KVC_ERR_ARG, "ExpectedAttention needs more queries in the forward call (%lld) than n_sink (%d)",
                        (long long)ctx->n, ns);
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] <= ns)
            return kvc_fail(KVC_ERR_ARG, "ExpectedAttention needs more tokens (%lld) than n_sink (%d)", (long long)len[h], ns);
    double freq[128], cb[128], sb[128];
    KVC_TRY(future_rope(lr, ctx, cfg->n_future, freq, cb, sb));
    const int64_t qd = (int64_t)H * d;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    const int cov_on = cfg->use_covariance != 0;
    double *mu = malloc(sizeof(double) * (size_t)qd), *cov = cov_on ? malloc(sizeof(double) * (size_t)qd * d) : NULL;
    float *B = malloc(sizeof(float) * (size_t)(d + 1) * d), *T = malloc(sizeof(float) * (size_t)maxlen * (d + 1));
    double *acc = malloc(sizeof(double) * (size_t)maxlen), *lg = malloc(sizeof(double) * (size_t)maxlen);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = mu && (cov || !cov_on) && B && T && acc && lg ? KVC_OK
                                                                 : kvc_fail(KVC_ERR_NOMEM, "out of memory: ExpectedAttention");
    if (st == KVC_OK && lr->q_mean) given_stats(lr, mu, cov);
    else if (st == KVC_OK) st = query_stats(lr, ctx, freq, ns, mu, cov);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    double top = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t nr = len[h] - ns;
        const float *kh = k[h] + (int64_t)ns * d;
        memset(acc, 0, sizeof(double) * (size_t)nr);
        for (int32_t j = 0; j < g; j++) {
            const int32_t hq = h * g + j;
            double *m = mu + (int64_t)hq * d;
            avg_rotate(c->rope_pairing, d, cb, sb, m, 1);
            /* B = [R Cov R^T; R mu]: one GEMM gives K (R Cov R^T) and K R mu */
            const int32_t cols = cov_on ? d + 1 : 1;
            if (cov_on) {
                double *C = cov + (int64_t)hq * d * d;
                for (int32_t col = 0; col < d; col++) avg_rotate(c->rope_pairing, d, cb, sb, C + col, d); /* R C */
                for (int32_t row = 0; row < d; row++) avg_rotate(c->rope_pairing, d, cb, sb, C + row * d, 1); /* (R C) R^T */
                for (int32_t i = 0; i < d * d; i++) B[i] = (float)C[i];
            }
            for (int32_t i = 0; i < d; i++) B[(int64_t)(cols - 1) * d + i] = (float)m[i];
            kvc_host_gemm_nt(kh, d, B, T, cols, nr, cols, d, 0);
            double mx = -INFINITY;
            for (int64_t r = 0; r < nr; r++) {
                double l = T[r * cols + cols - 1] / sqrt((double)d);
                if (cov_on) {
                    double quad = 0;
                    for (int32_t i = 0; i < d; i++) quad += (double)T[r * cols + i] * kh[r * d + i];
                    l += quad / d / 2;
                }
                lg[r] = l;
                mx = fmax(mx, l);
            }
            double sum = 0;
            for (int64_t r = 0; r < nr; r++) sum += (lg[r] = exp(lg[r] - mx));
            for (int64_t r = 0; r < nr; r++) acc[r] += lg[r] / sum / g;
        }
        for (int64_t r = 0; r < nr; r++) {
            double s = acc[r];
            if (cfg->use_vnorm) {
                const float *vr = v[h] + (r + ns) * d;
                double vn = 0;
                for (int32_t i = 0; i < d; i++) vn += (double)vr[i] * vr[i];
                s = (s + cfg->epsilon) * sqrt(vn);
            }
            scores[h][r + ns] = (float)s;
            top = fmax(top, (double)scores[h][r + ns]);
        }
    }
    /* the sinks: the layer's maximum + 1, as kvpress pads them */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        for (int32_t r = 0; r < ns; r++) scores[h][r] = (float)(top + 1);
    kvc_free(block);
    free(mu);
    free(cov);
    free(B);
    free(T);
    free(acc);
    free(lg);
    return st;
}

/* ---- NonCausalAttn ---- */

/* Whether the layer holds exactly this call's rows (a prefill with no past): what the prefill-only scorers need. */
static int plain_prefill(const kvc_layer_ctx *ctx, const int64_t *len, int32_t Hkv) {
    for (int32_t h = 0; h < Hkv; h++)
        if (ctx->past_len[h] != 0 || len[h] != ctx->n) return 0;
    return 1;
}

/* scores[h][r0 + r] = the z-score of acc[h n + r] over every head and row (torch's unbiased std, at least
 * 1e-6): NonCausalAttn's and LeverageScore's last step */
static void zscore(const double *acc, int32_t Hkv, int64_t n, int64_t r0, float *const *scores) {
    const double cnt = (double)Hkv * (double)n;
    double mean = 0, ss = 0;
    for (int64_t i = 0; i < (int64_t)Hkv * n; i++) mean += acc[i];
    mean /= cnt;
    for (int64_t i = 0; i < (int64_t)Hkv * n; i++) ss += (acc[i] - mean) * (acc[i] - mean);
    const double sd = fmax(cnt > 1 ? sqrt(ss / (cnt - 1)) : 0.0, 1e-6);
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < n; r++) scores[h][r0 + r] = (float)((acc[(size_t)h * n + r] - mean) / sd);
}

/* NonCausalAttn's z-scores of the prefill's rows [r0, r0 + n) alone (Compactor scores a middle slice),
 * written to scores[h][r0 + r]. */
static kvc_status noncausal_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, int64_t r0, int64_t n, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, C = cfg->attn_chunk;
    float *qt = malloc(sizeof(float) * (size_t)C * (size_t)qd), *qh = malloc(sizeof(float) * (size_t)C * d);
    float *dots = malloc(sizeof(float) * (size_t)C * (size_t)C);
    double *acc = calloc((size_t)Hkv * (size_t)n, sizeof(double));
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = qt && qh && dots && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: NonCausalAttn");
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int64_t c0 = 0; c0 < n && st == KVC_OK; c0 += C) {
        const int64_t m = n - c0 < C ? n - c0 : C; /* real rows of this chunk; C - m padded */
        st = lr->be->download(kvc_view_at(ctx->q, r0 + c0, 0), m, qd, qt, KVC_F32);
        for (int32_t hq = 0; hq < H && st == KVC_OK; hq++) {
            const int32_t h = hq / g;
            for (int64_t i = 0; i < m; i++) memcpy(qh + i * d, qt + i * qd + (int64_t)hq * d, sizeof(float) * d);
            kvc_host_gemm_nt(qh, d, k[h] + (r0 + c0) * d, dots, m, m, m, d, 0);
            /* each real query's softmax over the real keys (q.k) and the C - m padded ones (-1e-9), in place */
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                float *p = dots + i * m;
                double mx = m < C ? -1e-9 : -INFINITY, sum;
                for (int64_t j = 0; j < m; j++) mx = fmax(mx, p[j]);
                sum = (double)(C - m) * exp(-1e-9 - mx);
                for (int64_t j = 0; j < m; j++) sum += exp((double)p[j] - mx);
                for (int64_t j = 0; j < m; j++) p[j] = (float)(exp((double)p[j] - mx) / sum);
            }
            /* the C - m padded (zero) queries see logit 0 on every real key: the same row each */
            const double pad = (double)(C - m) / ((double)m + (double)(C - m) * exp(-1e-9));
            double *a = acc + (size_t)h * n + c0;
#pragma omp parallel for schedule(static)
            for (int64_t j = 0; j < m; j++) {
                double col = pad;
                for (int64_t i = 0; i < m; i++) col += dots[i * m + j];
                a[j] += col / g;
            }
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        double *a = acc + (size_t)h * n;
        for (int64_t r = 0; r < n; r++) {
            double vn = 0;
            for (int32_t i = 0; i < d; i++) vn += (double)v[h][(r0 + r) * d + i] * v[h][(r0 + r) * d + i];
            a[r] *= sqrt(vn);
        }
        double prev = 0;
        for (int64_t r = 0; r < n; r++) { /* avg_pool1d(3, padding 1), the padding counted */
            const double cur = a[r], next = r + 1 < n ? a[r + 1] : 0.0;
            a[r] = (prev + cur + next) / 3.0;
            prev = cur;
        }
    }
    if (st == KVC_OK) zscore(acc, Hkv, n, r0, scores);
    kvc_free(block);
    free(qt);
    free(qh);
    free(dots);
    free(acc);
    return st;
}

static kvc_status noncausal_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                   const int64_t *len, float *const *scores) {
    if (!plain_prefill(ctx, len, lr->mc->n_kv_heads))
        return kvc_fail(KVC_ERR_ARG, "NonCausalAttnPress scores a prefill with no past in the cache (kvpress: prefill only)");
    return noncausal_range(lr, ctx, cfg, len, 0, ctx->n, scores);
}

/* ---- LeverageScore ---- */

/* The Gaussian sketch of a layer, count values N(0, 1) as float: splitmix64 from the state
 * seed + (layer + 1) * 0x9E3779B97F4A7C15, pairs by Box-Muller (u1 = (x1 >> 11 + 1) 2^-53, u2 = (x2 >> 11) 2^-53,
 * r = sqrt(-2 ln u1): r cos(2 pi u2), r sin(2 pi u2)). tests/reference/kvpress_scorers_reference.py has the same. */
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void gaussian_sketch(uint64_t seed, int32_t layer, int64_t count, float *out) {
    uint64_t s = seed + (uint64_t)(layer + 1) * 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < count; i += 2) {
        const double u1 = (double)((splitmix64(&s) >> 11) + 1) * 0x1p-53, u2 = (double)(splitmix64(&s) >> 11) * 0x1p-53;
        const double r = sqrt(-2.0 * log(u1)), a = 2.0 * M_PI * u2;
        out[i] = (float)(r * cos(a));
        if (i + 1 < count) out[i + 1] = (float)(r * sin(a));
    }
}

/* Lower Cholesky factor of the k x k matrix a (in place); 0 when not positive definite. */
static int cholesky(double *a, int32_t k) {
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

/* One head's leverage of its n pre-RoPE keys x [n, d] (double) under the sketch phi [d, kk]:
 * X = (x - mean) phi, score_r = max(0, X_r (X^T X + j I)^-1 X_r^T), j = 1e-2 then 10x (5 tries, as kvpress). */
static kvc_status leverage_head(const double *x, int64_t n, int32_t d, const float *phi, int32_t kk, double *out) {
    double *X = malloc(sizeof(double) * (size_t)n * kk), *G = malloc(sizeof(double) * (size_t)kk * kk);
    double *L = malloc(sizeof(double) * (size_t)kk * kk), *mean = calloc((size_t)d, sizeof(double)), *y = malloc(sizeof(double) * kk);
    kvc_status st = X && G && L && mean && y ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: LeverageScore");
    for (int64_t r = 0; st == KVC_OK && r < n; r++)
        for (int32_t i = 0; i < d; i++) mean[i] += x[r * d + i] / (double)n;
    for (int64_t r = 0; st == KVC_OK && r < n; r++)
        for (int32_t j = 0; j < kk; j++) {
            double v = 0;
            for (int32_t i = 0; i < d; i++) v += (x[r * d + i] - mean[i]) * phi[i * kk + j];
            X[r * kk + j] = v;
        }
    for (int32_t a = 0; st == KVC_OK && a < kk; a++)
        for (int32_t b = 0; b <= a; b++) {
            double v = 0;
            for (int64_t r = 0; r < n; r++) v += X[r * kk + a] * X[r * kk + b];
            G[a * kk + b] = G[b * kk + a] = v;
        }
    int ok = 0;
    for (int t = 0; st == KVC_OK && t < 5 && !ok; t++) {
        const double jit = 1e-2 * pow(10.0, t);
        memcpy(L, G, sizeof(double) * (size_t)kk * kk);
        for (int32_t a = 0; a < kk; a++) L[a * kk + a] += jit;
        ok = cholesky(L, kk);
    }
    if (st == KVC_OK && !ok) st = kvc_fail(KVC_ERR_INTERNAL, "LeverageScore: Cholesky of the sketched Gram matrix failed after 5 jitters (as kvpress raises)");
    for (int64_t r = 0; st == KVC_OK && r < n; r++) { /* y = L^-T L^-1 X_r, score = X_r . y */
        const double *xr = X + r * kk;
        for (int32_t i = 0; i < kk; i++) {
            double v = xr[i];
            for (int32_t t = 0; t < i; t++) v -= L[i * kk + t] * y[t];
            y[i] = v / L[i * kk + i];
        }
        for (int32_t i = kk - 1; i >= 0; i--) {
            double v = y[i];
            for (int32_t t = i + 1; t < kk; t++) v -= L[t * kk + i] * y[t];
            y[i] = v / L[i * kk + i];
        }
        double sc = 0;
        for (int32_t i = 0; i < kk; i++) sc += xr[i] * y[i];
        out[r] = sc > 0 ? sc : 0;
    }
    free(X);
    free(G);
    free(L);
    free(mean);
    free(y);
    return st;
}

/* LeverageScore's z-scores of the prefill's rows [r0, r0 + n) alone, written to scores[h][r0 + r]. */
static kvc_status leverage_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                 const int64_t *len, int64_t r0, int64_t n, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim, half = d / 2, kk = cfg->sketch_dim;
    double freq[128];
    KVC_TRY(layer_freqs(lr, freq));
    float *hf = malloc(sizeof(float) * (size_t)Hkv * d * kk), *phi = malloc(sizeof(float) * (size_t)d * kk);
    double *x = malloc(sizeof(double) * (size_t)n * d), *acc = malloc(sizeof(double) * (size_t)Hkv * n);
    float *k[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = hf && phi && x && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: LeverageScore");
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 0, k, NULL, &block);
    /* kvpress's sketch [Hkv, d, kk] is over HF's (half-split) dimensions: with adjacent pairs, ours are permuted */
    if (st == KVC_OK) gaussian_sketch(cfg->seed, ctx->layer, (int64_t)Hkv * d * kk, hf);
    const float scale = (float)(1.0 / sqrt((double)kk));
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        for (int32_t j = 0; j < half; j++) {
            int32_t a, b;
            rope_pair(c->rope_pairing, d, j, &a, &b);
            for (int32_t t = 0; t < kk; t++) {
                phi[a * kk + t] = hf[((int64_t)h * d + j) * kk + t] * scale;
                phi[b * kk + t] = hf[((int64_t)h * d + j + half) * kk + t] * scale;
            }
        }
        for (int64_t r = 0; r < n; r++) { /* RoPE undone at the row's position */
            const double pos = (double)(ctx->pos ? ctx->pos[r0 + r] : r0 + r);
            const float *kr = k[h] + (r0 + r) * d;
            for (int32_t j = 0; j < half; j++) {
                int32_t a, b;
                rope_pair(c->rope_pairing, d, j, &a, &b);
                const double cs = cos(pos * freq[j]), sn = sin(pos * freq[j]);
                x[r * d + a] = kr[a] * cs + kr[b] * sn;
                x[r * d + b] = -kr[a] * sn + kr[b] * cs;
            }
        }
        st = leverage_head(x, n, d, phi, kk, acc + (size_t)h * n);
    }
    if (st == KVC_OK) zscore(acc, Hkv, n, r0, scores);
    kvc_free(block);
    free(hf);
    free(phi);
    free(x);
    free(acc);
    return st;
}

static kvc_status leverage_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    if (!plain_prefill(ctx, len, lr->mc->n_kv_heads))
        return kvc_fail(KVC_ERR_ARG, "LeverageScorePress scores a prefill with no past in the cache (kvpress: prefill only)");
    return leverage_range(lr, ctx, cfg, len, 0, ctx->n, scores);
}

/* ---- Compactor: blend * LeverageScore + NonCausalAttn over the rows between the sinks ---- */

static kvc_status compactor_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                   const int64_t *len, float *const *scores) {
    const int32_t Hkv = lr->mc->n_kv_heads;
    const int64_t n = ctx->n;
    if (!plain_prefill(ctx, len, Hkv))
        return kvc_fail(KVC_ERR_ARG, "CompactorPress scores a prefill with no past in the cache (kvpress: prefill only)");
    const int64_t left = cfg->cmp_sink_start < n ? cfg->cmp_sink_start : n;
    const int64_t right = cfg->cmp_sink_end < n - left ? cfg->cmp_sink_end : n - left, m = n - left - right;
    if (m < 2)
        return kvc_fail(KVC_ERR_ARG, "CompactorPress needs at least 2 rows between its %lld + %lld sinks, got %lld tokens",
                        (long long)left, (long long)right, (long long)n);
    float *lev[KVC_MAX_KV_HEADS] = {0}, *block = malloc(sizeof(float) * (size_t)Hkv * (size_t)n);
    if (!block) return kvc_fail(KVC_ERR_NOMEM, "out of memory: Compactor");
    for (int32_t h = 0; h < Hkv; h++) lev[h] = block + (size_t)h * n;
    kvc_status st = leverage_range(lr, ctx, cfg, len, left, m, lev);
    if (st == KVC_OK) st = noncausal_range(lr, ctx, cfg, len, left, m, scores);
    float mx = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        for (int64_t r = left; r < left + m; r++) {
            scores[h][r] = cfg->cmp_blend * lev[h][r] + scores[h][r];
            mx = scores[h][r] > mx ? scores[h][r] : mx;
        }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) { /* the sinks: the layer's maximum (kvpress pads with it) */
        for (int64_t r = 0; r < left; r++) scores[h][r] = mx;
        for (int64_t r = left + m; r < n; r++) scores[h][r] = mx;
    }
    free(block);
    return st;
}

/* ---- CUR (CurDKV) ---- */

#define CUR_SKETCH 20 /* kvpress's r */

/* x2[r] = ||x_r||^2, or ||x_r G||^2 with the sketch g [d, CUR_SKETCH] (NULL: none); then, with a window w,
 * divided by the sum over its block of w rows (blocks from row 0, the last one zero-padded). */
static void cur_norms(const float *x, int64_t n, int32_t d, const float *g, int32_t w, double *x2) {
    for (int64_t r = 0; r < n; r++) {
        double s = 0;
        if (g) {
            for (int32_t j = 0; j < CUR_SKETCH; j++) {
                double p = 0;
                for (int32_t i = 0; i < d; i++) p += (double)x[r * d + i] * g[i * CUR_SKETCH + j];
                s += p * p;
            }
        } else {
            for (int32_t i = 0; i < d; i++) s += (double)x[r * d + i] * x[r * d + i];
        }
        x2[r] = s;
    }
    for (int64_t b = 0; w > 0 && b < n; b += w) {
        const int64_t e = b + w < n ? b + w : n;
        double s = 0;
        for (int64_t r = b; r < e; r++) s += x2[r];
        for (int64_t r = b; r < e; r++) x2[r] /= s;
    }
}

static kvc_status cur_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                             const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim, half = d / 2;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    float *gh = cfg->cur_random ? malloc(sizeof(float) * (size_t)d * CUR_SKETCH) : NULL;
    float *gk = cfg->cur_random ? malloc(sizeof(float) * (size_t)d * CUR_SKETCH) : NULL;
    double *k2 = malloc(sizeof(double) * (size_t)maxlen), *v2 = malloc(sizeof(double) * (size_t)maxlen);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = k2 && v2 && (!cfg->cur_random || (gh && gk)) ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CUR");
    if (st == KVC_OK && cfg->cur_random) {
        /* kvpress's G = randn(d, 20) / sqrt(20) over HF's dimensions: V's are ours; K's rows follow RoPE's pairs */
        gaussian_sketch(cfg->seed, ctx->layer, (int64_t)d * CUR_SKETCH, gh);
        const float sq = (float)sqrt((double)CUR_SKETCH);
        for (int32_t i = 0; i < d * CUR_SKETCH; i++) gh[i] /= sq; /* randn / sqrt(r) in float, as torch */
        for (int32_t j = 0; j < half; j++) {
            int32_t a, b;
            rope_pair(c->rope_pairing, d, j, &a, &b);
            memcpy(gk + (int64_t)a * CUR_SKETCH, gh + (int64_t)j * CUR_SKETCH, sizeof(float) * CUR_SKETCH);
            memcpy(gk + (int64_t)b * CUR_SKETCH, gh + (int64_t)(j + half) * CUR_SKETCH, sizeof(float) * CUR_SKETCH);
        }
    }
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t n = len[h];
        cur_norms(k[h], n, d, gk, cfg->cur_window, k2);
        cur_norms(v[h], n, d, gh, cfg->cur_window, v2);
        double tot = 0;
        for (int64_t r = 0; r < n; r++) {
            const double s = cfg->cur_type == 0 ? k2[r] : cfg->cur_type == 1 ? v2[r]
                           : cfg->cur_type == 2 ? (k2[r] + v2[r]) / 2 : k2[r] * v2[r];
            k2[r] = s;
            tot += s;
        }
        for (int64_t r = 0; r < n; r++) scores[h][r] = r < cfg->n_sink ? 1.0f : (float)(k2[r] / tot);
    }
    kvc_free(block);
    free(gh);
    free(gk);
    free(k2);
    free(v2);
    return st;
}

/* ---- CapPress (CAPKV) ---- */

/* Per query head hq: the anchor a = R mu (mu: the mean of this call's pre-RoPE queries after the first n_sink,
 * R: RoPE averaged over the next n_future positions, as ExpectedAttention), w_t = exp(tau (cos(a, k_t) - max)) over
 * the rows t >= n_sink, A = I + sum_t (w_t + eps) v_t v_t^T, score_t = w_t v_t^T A^-1 v_t; the mean over the group;
 * the sinks score the layer's maximum + 1. Cosines clamp to [-1, 1] with norms at least 1e-12 (F.normalize). */
static kvc_status cap_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                             const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, ns = cfg->n_sink;
    if (ctx->n <= ns)
        return kvc_fail(KVC_ERR_ARG, "CapPress needs more queries in the forward call (%lld) than n_sink (%d)",
                        (long long)ctx->n, ns);
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] <= ns)
            return kvc_fail(KVC_ERR_ARG, "Input cache length (%lld) must be larger than n_sink=%d", (long long)len[h], ns);
    double freq[128], cb[128], sb[128];
    KVC_TRY(future_rope(lr, ctx, cfg->n_future, freq, cb, sb));
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    double *mu = malloc(sizeof(double) * (size_t)H * d), *A = malloc(sizeof(double) * (size_t)d * d);
    double *w = malloc(sizeof(double) * (size_t)maxlen), *acc = malloc(sizeof(double) * (size_t)maxlen);
    double *x = malloc(sizeof(double) * (size_t)d);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = mu && A && w && acc && x ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CapPress");
    if (st == KVC_OK) st = query_stats(lr, ctx, freq, ns, mu, NULL);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    double top = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t nr = len[h] - ns;
        const float *kh = k[h] + (int64_t)ns * d, *vh = v[h] + (int64_t)ns * d;
        memset(acc, 0, sizeof(double) * (size_t)nr);
        for (int32_t j = 0; j < g && st == KVC_OK; j++) {
            double *a = mu + (int64_t)(h * g + j) * d, an = 0, mx = -INFINITY;
            avg_rotate(c->rope_pairing, d, cb, sb, a, 1);
            for (int32_t i = 0; i < d; i++) an += a[i] * a[i];
            an = fmax(sqrt(an), 1e-12);
            for (int64_t r = 0; r < nr; r++) {
                double dot = 0, kn = 0;
                for (int32_t i = 0; i < d; i++) {
                    dot += a[i] * kh[r * d + i];
                    kn += (double)kh[r * d + i] * kh[r * d + i];
                }
                double cs = dot / an / fmax(sqrt(kn), 1e-12);
                w[r] = cfg->cap_tau * (cs < -1 ? -1 : cs > 1 ? 1 : cs);
                mx = fmax(mx, w[r]);
            }
            for (int64_t r = 0; r < nr; r++) w[r] = exp(w[r] - mx);
            for (int32_t i = 0; i < d * d; i++) A[i] = i % (d + 1) == 0 ? 1.0 : 0.0;
            for (int64_t r = 0; r < nr; r++) { /* A += (w + eps) v v^T, lower triangle */
                const double s = w[r] + cfg->epsilon;
                const float *vr = vh + r * d;
                for (int32_t p = 0; p < d; p++)
                    for (int32_t q = 0; q <= p; q++) A[p * d + q] += s * vr[p] * vr[q];
            }
            if (!cholesky(A, d)) {
                st = kvc_fail(KVC_ERR_INTERNAL, "CapPress: the capacity matrix of layer %d head %d is not positive definite",
                              ctx->layer, h * g + j);
                break;
            }
            for (int64_t r = 0; r < nr; r++) { /* v^T A^-1 v = ||L^-1 v||^2 */
                double lev = 0;
                for (int32_t p = 0; p < d; p++) {
                    double y = vh[r * d + p];
                    for (int32_t q = 0; q < p; q++) y -= A[p * d + q] * x[q];
                    x[p] = y / A[p * d + p];
                    lev += x[p] * x[p];
                }
                acc[r] += w[r] * lev / g;
            }
        }
        for (int64_t r = 0; r < nr && st == KVC_OK; r++) {
            scores[h][r + ns] = (float)acc[r];
            top = fmax(top, (double)scores[h][r + ns]);
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) /* the sinks: the layer's maximum + 1, as kvpress pads them */
        for (int32_t r = 0; r < ns; r++) scores[h][r] = (float)(top + 1);
    kvc_free(block);
    free(mu); free(A); free(w); free(acc); free(x);
    return st;
}

kvc_status kvc_host_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                           const int64_t *len, float *const *scores) {
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    if (cfg->scorer == KVC_SCORE_EXPECTED) return expected_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_NONCAUSAL) return noncausal_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_LEVERAGE) return leverage_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_CUR) return cur_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_COMPACTOR) return compactor_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_FINCH || cfg->scorer == KVC_SCORE_SIMLAYERKV) return kvc_finch_scores(lr, ctx, cfg, len, scores);
    if (cfg->scorer == KVC_SCORE_CAP) return cap_scores(lr, ctx, cfg, len, scores);
    const int want_v = cfg->scorer == KVC_SCORE_LAGKV;
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = kvc_press_layer_rows(lr, len, want_v, k, v, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (cfg->scorer == KVC_SCORE_KEYDIFF)
            keydiff_head(k[h], len[h], d, scores[h]);
        else
            st = lagkv_head(k[h], v[h], len[h], d, cfg->n_sink, cfg->lag_size, cfg->cross_scoring, scores[h]);
    }
    kvc_free(block);
    return st;
}
