/* KVCompose (arXiv 2509.05165; kvpress's KVComposePress; docs/METHODS.md "KVCompose"): attention-guided
 * allocation of the context's rows across layers (structured: one count per layer) or across every layer and
 * head (unstructured), each head then keeping its own best rows.
 *
 * kvc_kvcompose_profile: after the context's full prefill, a prompt (kvpress: the context itself) runs on the
 * full cache, as KVzip's reconstruction does (kvzip.c): a layer hook computes each query's softmax attention over
 * every row it sees (the context and the causal prompt rows, 1/sqrt(d)) on the host, keeps per attention head and
 * context row the maximum or the sum over the queries, then drops the prompt's rows; the position goes back.
 * kvc_kvcompose_evict: from those per-head statistics, kvpress's aggregation, composite scores, allocation and
 * per-head selection, then a real compaction of every layer. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../model/model.h"
#include "press.h"

#define KVCOMPOSE_TILE 64

typedef struct {
    int64_t n_ctx;
    int32_t sum; /* 0: maximum over the queries, 1: sum */
    float *out;  /* [L, H, n_ctx] */
} profile_state;

static kvc_status profile_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    profile_state *t = user;
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t l = ctx->layer, H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t q = ctx->n, qd = (int64_t)H * d, n_ctx = t->n_ctx, rows = n_ctx + q;
    const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    const int64_t *len = kvc_door_cache(s)->layers[l].len;
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    float *qh = malloc(sizeof(float) * (size_t)(q * qd));
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    kvc_status st = qh ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (len[h] != rows) st = kvc_fail(KVC_ERR_INTERNAL, "KVCompose: head %d holds %lld rows, not %lld", h, (long long)len[h], (long long)rows);
    if (st == KVC_OK) st = kvc_press_layer_rows(&lr, len, 0, k, v, &block);
    if (st == KVC_OK) st = kvc_door_backend(s)->download(ctx->q, q, qd, qh, KVC_F32);
    float *out = t->out + (size_t)l * H * n_ctx;
    int failed = 0;
    if (st == KVC_OK) {
#pragma omp parallel
        {
            float *qt = malloc(sizeof(float) * KVCOMPOSE_TILE * (size_t)d);
            float *pr = malloc(sizeof(float) * KVCOMPOSE_TILE * (size_t)rows);
            double *acc = malloc(sizeof(double) * (size_t)(n_ctx > 0 ? n_ctx : 1));
            int64_t vis[KVCOMPOSE_TILE];
            const int ok = qt && pr && acc;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic)
            for (int32_t hq = 0; hq < H; hq++) {
                if (!ok) continue;
                for (int64_t r = 0; r < n_ctx; r++) acc[r] = t->sum ? 0.0 : -INFINITY;
                for (int64_t i0 = 0; i0 < q; i0 += KVCOMPOSE_TILE) {
                    const int64_t tq = q - i0 < KVCOMPOSE_TILE ? q - i0 : KVCOMPOSE_TILE, cols = n_ctx + i0 + tq;
                    for (int64_t i = 0; i < tq; i++) {
                        memcpy(qt + i * d, qh + (i0 + i) * qd + (int64_t)hq * d, sizeof(float) * (size_t)d);
                        vis[i] = n_ctx + i0 + i + 1;
                    }
                    kvc_host_probs_rows(qt, tq, k[hq / g], cols, d, (float)(1.0 / sqrt((double)d)), vis, pr);
                    for (int64_t i = 0; i < tq; i++)
                        for (int64_t r = 0; r < n_ctx; r++) {
                            const double a = pr[i * cols + r];
                            acc[r] = t->sum ? acc[r] + a : fmax(acc[r], a);
                        }
                }
                for (int64_t r = 0; r < n_ctx; r++) out[(int64_t)hq * n_ctx + r] = (float)acc[r];
            }
            free(qt);
            free(pr);
            free(acc);
        }
        if (failed) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
    }
    /* the prompt's rows go: the layer holds the context again */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(n_ctx > 0 ? n_ctx : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
        for (int64_t r = 0; st == KVC_OK && r < n_ctx; r++) keep[h][r] = r;
        n_keep[h] = n_ctx;
    }
    if (st == KVC_OK) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    kvc_free(block);
    free(qh);
    return st;
}

kvc_status kvc_session_kvcompose_profile(kvc_session *s, const int32_t *ids, int64_t q_len, int32_t sum, float *out,
                                         int64_t n_out) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVCompose"));
    const int64_t n_ctx = kvc_door_position(s);
    if (!ids || !out) return kvc_fail(KVC_ERR_ARG, "kvcompose_profile: null argument");
    KVC_TRY(kvc_check_size("kvcompose_profile: out [L, H, n_ctx]", n_out, (int64_t)c->n_layers * c->n_heads * n_ctx));
    if (n_ctx < 1 || !kvc_door_holds_full_cache(s))
        return kvc_fail(KVC_ERR_ARG, "kvcompose_profile: the session must hold the full cache of the context (prefill it "
                        "without a press first)");
    if (q_len < 1) return kvc_fail(KVC_ERR_ARG, "kvcompose_profile: the prompt is empty");
    for (int64_t i = 0; i < q_len; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab) return kvc_fail(KVC_ERR_ARG, "token %d outside the vocabulary", ids[i]);
    profile_state t = {n_ctx, sum != 0, out};
    /* a one-token prompt takes the decode path, which runs no hook: it goes through as a prefill row would */
    if (q_len < 2) return kvc_fail(KVC_ERR_ARG, "kvcompose_profile: the prompt needs at least 2 tokens");
    /* the hook drops the prompt's rows again: the position goes back */
    return kvc_door_probe(s, ids, q_len, NULL, 0, profile_hook, &t, KVC_ROW_NONE, NULL, 0);
}

typedef struct { double s; int64_t i; } ranked;
static int by_score_desc(const void *a, const void *b) { /* higher first, then lower index */
    const ranked *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}
static int by_row(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}
static int by_value_desc(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : x < y;
}

/* counts[b] = how many of the top n_kept entries of comp [bins, n] fall in bin b. */
static kvc_status top_counts(const double *comp, int64_t bins, int64_t n, int64_t n_kept, int64_t *counts) {
    ranked *r = malloc(sizeof(ranked) * (size_t)(bins * n));
    if (!r) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
    for (int64_t i = 0; i < bins * n; i++) r[i] = (ranked){comp[i], i};
    qsort(r, (size_t)(bins * n), sizeof *r, by_score_desc);
    memset(counts, 0, sizeof(int64_t) * (size_t)bins);
    for (int64_t i = 0; i < n_kept; i++) counts[r[i].i / n]++;
    free(r);
    return KVC_OK;
}

kvc_status kvc_session_kvcompose_evict(kvc_session *s, const float *task, int64_t n_task, double ratio, int32_t structured,
                                       int32_t group_max, int32_t head_max, int32_t add_v_norm, int32_t add_mean,
                                       int64_t lower_bound) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVCompose"));
    const int32_t L = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t n = kvc_door_position(s), LH = (int64_t)L * Hkv;
    if (!task) return kvc_fail(KVC_ERR_ARG, "kvcompose_evict: null scores");
    KVC_TRY(kvc_check_size("kvcompose_evict: task [L, H, n]", n_task, (int64_t)L * H * n));
    if (!(ratio >= 0 && ratio < 1)) return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1), got %g", ratio);
    if (lower_bound < 0) return kvc_fail(KVC_ERR_ARG, "keep_token_lower_bound must be >= 0, got %lld", (long long)lower_bound);
    if (n < 1 || !kvc_door_holds_full_cache(s)) return kvc_fail(KVC_ERR_ARG, "kvcompose_evict: the session must hold the full cache of the context");
    const int64_t lb = lower_bound < n ? lower_bound : n;
    double *sc = malloc(sizeof(double) * (size_t)(LH * n)), *comp = malloc(sizeof(double) * (size_t)(LH * n));
    double *lay = calloc((size_t)(L * n), sizeof(double)), *mean = malloc(sizeof(double) * (size_t)n);
    float *vrow = add_v_norm ? malloc(sizeof(float) * (size_t)(n * d)) : NULL;
    int64_t *count = malloc(sizeof(int64_t) * (size_t)LH), *lcount = malloc(sizeof(int64_t) * (size_t)L);
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    ranked *order = malloc(sizeof(ranked) * (size_t)n);
    kvc_status st = sc && comp && lay && mean && (vrow || !add_v_norm) && count && lcount && order
                        ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
    /* scores[l, h] = the group's aggregate of its heads' statistics; times ||v||; plus the mean over heads */
    for (int32_t l = 0; l < L && st == KVC_OK; l++) {
        for (int32_t h = 0; h < Hkv; h++) {
            double *o = sc + ((int64_t)l * Hkv + h) * n;
            for (int64_t r = 0; r < n; r++) {
                double a = group_max ? -INFINITY : 0.0;
                for (int32_t j = 0; j < g; j++) {
                    const double x = task[((int64_t)l * H + h * g + j) * n + r];
                    a = group_max ? fmax(a, x) : a + x / g;
                }
                o[r] = a;
            }
            if (add_v_norm) {
                st = kvc_door_backend(s)->kv_read(kvc_door_cache(s)->layers[l].kv, h, 0, n, NULL, vrow);
                for (int64_t r = 0; r < n && st == KVC_OK; r++) {
                    double vv = 0;
                    for (int32_t i = 0; i < d; i++) vv += (double)vrow[r * d + i] * vrow[r * d + i];
                    o[r] *= sqrt(vv);
                }
            }
        }
        if (add_mean && st == KVC_OK) {
            for (int64_t r = 0; r < n; r++) {
                mean[r] = 0;
                for (int32_t h = 0; h < Hkv; h++) mean[r] += sc[((int64_t)l * Hkv + h) * n + r] / Hkv;
            }
            for (int32_t h = 0; h < Hkv; h++)
                for (int64_t r = 0; r < n; r++) sc[((int64_t)l * Hkv + h) * n + r] += mean[r];
        }
    }
    if (st == KVC_OK) {
        /* composite scores: each head's scores sorted (descending); per layer, the heads' aggregate of them */
        for (int64_t i = 0; i < LH; i++) {
            memcpy(comp + i * n, sc + i * n, sizeof(double) * (size_t)n);
            qsort(comp + i * n, (size_t)n, sizeof(double), by_value_desc);
        }
        for (int32_t l = 0; l < L; l++)
            for (int64_t r = 0; r < n; r++) {
                double a = head_max ? -INFINITY : 0.0;
                for (int32_t h = 0; h < Hkv; h++) {
                    const double x = comp[((int64_t)l * Hkv + h) * n + r];
                    a = head_max ? fmax(a, x) : a + x / Hkv;
                }
                lay[(int64_t)l * n + r] = a + (r < lb ? 1e9 : 0.0);
            }
        for (int64_t i = 0; i < LH; i++)
            for (int64_t r = 0; r < lb; r++) comp[i * n + r] += 1e9;
        for (int64_t r = 0; r < n; r++) /* the first layer keeps the most: the maximum over layers */
            for (int32_t l = 1; l < L; l++) lay[r] = fmax(lay[r], lay[(int64_t)l * n + r]);
        if (structured) {
            st = top_counts(lay, L, n, kvc_n_kept_ratio((int64_t)L * n, ratio), lcount);
            const int64_t floor_ = lb > 1 ? lb : 1;
            for (int32_t l = 0; l < L; l++) lcount[l] = lcount[l] < floor_ ? floor_ : lcount[l];
        } else {
            st = top_counts(comp, LH, n, kvc_n_kept_ratio(LH * n, ratio), count);
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)n))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVCompose");
    /* each head keeps its own top rows by its scores (ties: the lower row), in position order */
    for (int32_t l = 0; l < L && st == KVC_OK; l++) {
        for (int32_t h = 0; h < Hkv; h++) {
            const double *o = sc + ((int64_t)l * Hkv + h) * n;
            for (int64_t r = 0; r < n; r++) order[r] = (ranked){o[r], r};
            qsort(order, (size_t)n, sizeof *order, by_score_desc);
            int64_t k = structured ? lcount[l] : count[(int64_t)l * Hkv + h];
            k = k < n ? k : n;
            for (int64_t i = 0; i < k; i++) keep[h][i] = order[i].i;
            qsort(keep[h], (size_t)k, sizeof(int64_t), by_row);
            n_keep[h] = k;
        }
        st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    }
    if (st != KVC_OK) kvc_door_request_reset(s);
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    free(sc); free(comp); free(lay); free(mean); free(vrow); free(count); free(lcount); free(order);
    return st;
}
