/* FastKVzipPress (kvpress; Fast KVzip, Kim et al., arXiv 2601.17668): per layer a small trained gate reads each
 * prompt token's normed hidden state (the attention block's input) and gives one score per KV head, an estimate
 * of KVzip's reconstruction score. The sinks and a recent window score 1 (the gate's maximum); once every layer
 * is scored (the last layer's hook), the lowest scores over all layers and heads are evicted at once, as KVzip's
 * eviction (kvzip.c, kvc_evict_lowest). Projections by the host fp32 GEMM, norms and the gate's sums in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../model/model.h"
#include "press.h"

#define FKZ_TILE 256 /* prompt rows per projection GEMM */

typedef struct kvc_fastkvzip kvc_fastkvzip;
struct kvc_fastkvzip {
    int32_t L, Hkv, D, G, od, nb; /* layers, KV heads, hidden, gate queries per head, gate head dim, k_base rows */
    float *wq, *bq, *wk, *qn, *kn, *kb, *b;
    float eps;
    int32_t n_sink, layerwise;
    int64_t window_size;
    double window_ratio;
    float *scores; /* [L, Hkv, n] of the prefill under way */
    int64_t n;
    int32_t scored; /* layers scored so far in it */
};

static void kvc_fastkvzip_free(kvc_fastkvzip *z) {
    if (!z) return;
    free(z->wq);
    free(z->bq);
    free(z->wk);
    free(z->qn);
    free(z->kn);
    free(z->kb);
    free(z->b);
    free(z->scores);
    free(z);
}

/* A finite copy of n floats (NULL with *st set otherwise). */
static float *copy_weights(const float *src, size_t n, const char *what, kvc_status *st) {
    if (*st != KVC_OK) return NULL;
    if (!src) {
        *st = kvc_fail(KVC_ERR_ARG, "FastKVzip: missing gate weights (%s)", what);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        if (!isfinite(src[i])) {
            *st = kvc_fail(KVC_ERR_ARG, "FastKVzip: gate weights %s hold a value that is not finite", what);
            return NULL;
        }
    float *p = malloc(sizeof(float) * (n ? n : 1));
    if (!p) *st = kvc_fail(KVC_ERR_NOMEM, "out of memory: FastKVzip gates");
    else memcpy(p, src, sizeof(float) * n);
    return p;
}

static kvc_status kvc_fastkvzip_new(const kvc_config *mc, const kvc_fastkvzip_config *cfg, kvc_fastkvzip **out) {
    *out = NULL;
    if (!cfg) return kvc_fail(KVC_ERR_ARG, "FastKVzip: null config");
    if (cfg->n_groups < 1 || cfg->out_dim < 1 || cfg->n_base < 0)
        return kvc_fail(KVC_ERR_ARG, "FastKVzip: n_groups and out_dim must be >= 1 and n_base >= 0, got %d, %d, %d",
                        cfg->n_groups, cfg->out_dim, cfg->n_base);
    if (cfg->out_dim > 256) return kvc_fail(KVC_ERR_ARG, "FastKVzip: out_dim must be <= 256, got %d", cfg->out_dim);
    if (!(cfg->norm_eps > 0)) return kvc_fail(KVC_ERR_ARG, "FastKVzip: norm_eps must be > 0, got %g", (double)cfg->norm_eps);
    if (cfg->n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", cfg->n_sink);
    if (cfg->window_size < 1) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 1, got %lld", (long long)cfg->window_size);
    if (!(cfg->window_ratio >= 0 && cfg->window_ratio <= 1))
        return kvc_fail(KVC_ERR_ARG, "window_ratio must be in [0, 1], got %g", cfg->window_ratio);
    kvc_fastkvzip *z = calloc(1, sizeof *z);
    if (!z) return kvc_fail(KVC_ERR_NOMEM, "out of memory: FastKVzip");
    z->L = mc->n_layers;
    z->Hkv = mc->n_kv_heads;
    z->D = mc->hidden;
    z->G = cfg->n_groups;
    z->od = cfg->out_dim;
    z->nb = cfg->n_base;
    z->eps = cfg->norm_eps;
    z->n_sink = cfg->n_sink;
    z->layerwise = cfg->layerwise != 0;
    z->window_size = cfg->window_size;
    z->window_ratio = cfg->window_ratio;
    const size_t L = (size_t)z->L, qrows = (size_t)z->Hkv * z->G * z->od, krows = (size_t)z->Hkv * z->od;
    kvc_status st = KVC_OK;
    z->wq = copy_weights(cfg->wq, L * qrows * (size_t)z->D, "q_proj.weight", &st);
    z->bq = copy_weights(cfg->bq, L * qrows, "q_proj.bias", &st);
    z->wk = copy_weights(cfg->wk, L * krows * (size_t)z->D, "k_proj.weight", &st);
    z->qn = copy_weights(cfg->q_norm, L * (size_t)z->od, "q_norm.weight", &st);
    z->kn = copy_weights(cfg->k_norm, L * (size_t)z->od, "k_norm.weight", &st);
    z->kb = copy_weights(cfg->k_base, L * krows * (size_t)z->nb, "k_base", &st);
    z->b = copy_weights(cfg->b, L * (size_t)z->Hkv * z->G, "b", &st);
    if (st != KVC_OK) {
        kvc_fastkvzip_free(z);
        return st;
    }
    *out = z;
    return KVC_OK;
}

/* x <- RMSNorm(x) w over od values (Qwen3RMSNorm: x / sqrt(mean x^2 + eps) * w). */
static void rms_norm(double *x, const float *w, int32_t od, double eps) {
    double ss = 0;
    for (int32_t i = 0; i < od; i++) ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / od + eps);
    for (int32_t i = 0; i < od; i++) x[i] = x[i] * inv * w[i];
}

/* The gate's score of one row for KV head h: mean over its groups of 1 / (1 + sum_s exp(base_s - logit)). */
static double gate_row(const kvc_fastkvzip *z, int32_t l, int32_t h, const float *qrow, const float *krow, double *q,
                       double *k) {
    const int32_t od = z->od, G = z->G;
    const double scale = 1.0 / sqrt((double)od);
    const float *kb = z->kb + ((size_t)l * z->Hkv + h) * z->nb * od, *b = z->b + ((size_t)l * z->Hkv + h) * G;
    for (int32_t i = 0; i < od; i++) k[i] = krow[i];
    rms_norm(k, z->kn + (size_t)l * od, od, z->eps);
    double score = 0;
    for (int32_t g = 0; g < G; g++) {
        const float *qg = qrow + ((size_t)h * G + g) * od;
        const float *bias = z->bq + (size_t)l * z->Hkv * G * od + ((size_t)h * G + g) * od;
        for (int32_t i = 0; i < od; i++) q[i] = (double)qg[i] + bias[i];
        rms_norm(q, z->qn + (size_t)l * od, od, z->eps);
        double logit = 0;
        for (int32_t i = 0; i < od; i++) logit += k[i] * q[i];
        logit = logit * scale + b[g];
        double sum = 0;
        for (int32_t sb = 0; sb < z->nb; sb++) {
            double base = 0;
            for (int32_t i = 0; i < od; i++) base += (double)kb[(size_t)sb * od + i] * q[i];
            sum += exp(base * scale - logit);
        }
        score += 1.0 / (1.0 + sum);
    }
    return score / G;
}

/* out [Hkv, n] (stride n): the gate scores of the n rows of x (the layer's normed input on the backend). */
static kvc_status gate_scores(const kvc_fastkvzip *z, const kvc_backend *be, const kvc_layer_ctx *ctx, float *out) {
    const int32_t l = ctx->layer, Hkv = z->Hkv, od = z->od;
    const int64_t n = ctx->n, D = z->D, qc = (int64_t)Hkv * z->G * od, kc = (int64_t)Hkv * od;
    float *x = malloc(sizeof(float) * FKZ_TILE * (size_t)D);
    float *Q = malloc(sizeof(float) * FKZ_TILE * (size_t)qc), *K = malloc(sizeof(float) * FKZ_TILE * (size_t)kc);
    kvc_status st = x && Q && K ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: FastKVzip scores");
    for (int64_t r0 = 0; r0 < n && st == KVC_OK; r0 += FKZ_TILE) {
        const int64_t t = n - r0 < FKZ_TILE ? n - r0 : FKZ_TILE;
        st = be->download(kvc_view_at(ctx->xn, r0, 0), t, D, x, KVC_F32);
        if (st != KVC_OK) break;
        kvc_host_gemm_nt(x, D, z->wq + (size_t)l * qc * D, Q, qc, t, qc, D, 0); /* bias added in double */
        kvc_host_gemm_nt(x, D, z->wk + (size_t)l * kc * D, K, kc, t, kc, D, 0);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < t; i++) {
            double q[256], k[256]; /* out_dim <= 256 (checked when the gates are set) */
            for (int32_t h = 0; h < Hkv; h++)
                out[(int64_t)h * n + r0 + i] = (float)gate_row(z, l, h, Q + i * qc, K + i * kc + (int64_t)h * od, q, k);
        }
    }
    free(x);
    free(Q);
    free(K);
    return st;
}

/* kvpress: the first n_sink rows and a window of the last rows score 1 (the window: max(1, int(n ratio)) below
 * 32000 rows, else window_size). */
static void protect(const kvc_fastkvzip *z, int64_t n, float *out) {
    const int64_t share = (int64_t)((double)n * z->window_ratio); /* Python's int(n * ratio) */
    const int64_t w = n < 32000 ? (share > 1 ? share : 1) : z->window_size;
    for (int32_t h = 0; h < z->Hkv; h++) {
        float *o = out + (int64_t)h * n;
        for (int64_t r = 0; r < z->n_sink && r < n; r++) o[r] = 1.0f;
        for (int64_t r = n - w > 0 ? n - w : 0; r < n; r++) o[r] = 1.0f;
    }
}

/* record_scores: each head's scores of this layer kept for kvc_session_press_scores. */
static kvc_status record(kvc_press *p, int32_t l, const float *layer_scores, int64_t n) {
    for (int32_t h = 0; h < p->n_kv; h++) {
        const size_t i = (size_t)l * p->n_kv + h;
        float *copy = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        if (!copy) return kvc_fail(KVC_ERR_NOMEM, "out of memory: recorded scores");
        memcpy(copy, layer_scores + (int64_t)h * n, sizeof(float) * (size_t)n);
        free(p->scores[i]);
        p->scores[i] = copy;
        p->score_len[i] = n;
    }
    return KVC_OK;
}

typedef struct {
    kvc_fastkvzip *z;
} fastkvzip_state;

static kvc_status fastkvzip_layer(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx) {
    kvc_fastkvzip *z = ((fastkvzip_state *)state)->z;
    const int32_t l = ctx->layer;
    const int64_t n = ctx->n, *len = kvc_door_cache(s)->layers[l].len;
    if (!ctx->xn.buf) return kvc_fail(KVC_ERR_UNSUPPORTED, "FastKVzip needs the hidden states of the forward call");
    for (int32_t h = 0; h < z->Hkv; h++)
        if (len[h] != n)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "FastKVzipPress scores the rows of one prefill from their hidden states: "
                            "the session must be empty before it (head %d holds %lld rows, the call %lld)", h,
                            (long long)len[h], (long long)n);
    if (l == 0) { /* a new prefill: room for every layer's scores */
        float *sc = realloc(z->scores, sizeof(float) * (size_t)z->L * z->Hkv * (size_t)n);
        if (!sc) return kvc_fail(KVC_ERR_NOMEM, "out of memory: FastKVzip scores of %lld rows", (long long)n);
        z->scores = sc;
        z->n = n;
        z->scored = 0;
    }
    if (l != z->scored || n != z->n)
        return kvc_fail(KVC_ERR_INTERNAL, "FastKVzip: layer %d of a prefill whose layers before it were not scored", l);
    float *out = z->scores + (size_t)l * z->Hkv * n;
    KVC_TRY(gate_scores(z, kvc_door_backend(s), ctx, out));
    protect(z, n, out);
    if (p->cfg.record_scores) KVC_TRY(record(p, l, out, n));
    z->scored = l + 1;
    if (l < z->L - 1 || p->cfg.compression_ratio <= 0) return KVC_OK;
    return kvc_evict_lowest(s, z->scores, 0, n, p->cfg.compression_ratio, z->layerwise, 0); /* sinks already score 1 */
}

static void release(void *state) { kvc_fastkvzip_free(((fastkvzip_state *)state)->z); }

static kvc_status admit(const kvc_press *p) {
    if (p->cfg.budget > 0)
        return kvc_fail(KVC_ERR_ARG, "FastKVzip makes its own global selection from a compression_ratio: attach a plain press");
    return KVC_OK;
}

/* its eviction ranks every layer's full rows at once: the session's only press */
static const kvc_press_part_i fastkvzip_part = {
    .name = "fastkvzip", .title = "FastKVzipPress", .traits = KVC_PART_SELECTS | KVC_PART_PLAIN | KVC_PART_ALONE,
    .order = 10, .state_size = sizeof(fastkvzip_state), .admit = admit, .release = release,
    .take_layer = fastkvzip_layer,
    .doc = "trained gates on the block's normed input score every layer's rows; one global eviction after the last"};
KVC_REGISTER_PART(fastkvzip_part);

kvc_status kvc_session_set_fastkvzip(kvc_session *s, const kvc_fastkvzip_config *cfg) {
    kvc_press *p = NULL;
    if (!cfg) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "FastKVzip"));
    KVC_TRY(kvc_last_press(s, &p));
    kvc_fastkvzip *z = NULL;
    KVC_TRY(kvc_fastkvzip_new(&kvc_door_model(s)->cfg, cfg, &z));
    fastkvzip_state *st = NULL;
    const kvc_status rc = kvc_press_part_state(p, &fastkvzip_part, (void **)&st);
    if (rc != KVC_OK) {
        kvc_fastkvzip_free(z);
        return rc;
    }
    kvc_fastkvzip_free(st->z);
    st->z = z;
    return KVC_OK;
}
