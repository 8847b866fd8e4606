/* Value merging on eviction (docs/METHODS.md, "Value merging on eviction"): the one place where evicted rows'
 * values are folded into kept rows before a compaction. Two rules, as kvpress 0.5.5 writes them:
 *   MergingPress (kvc_merge_similar): each evicted row's value goes into its most key-similar kept row of the
 *     same head, weighted by similarity and relative value norm, then a normalised blend;
 *   CAMPress (kvc_cam_merge): CaM's merge of the decoding press: one selection for the layer (the scores'
 *     mean over heads), the best-scored evicted rows each spread their value over the next merge_budget kept
 *     rows with a Bernoulli probability from the cumulative attention.
 * The arithmetic runs on host arrays (float64 accumulation); the session path brings a layer's rows to the
 * host with the backend's kv_read, writes the merged kept values back with kv_write, and the compaction that
 * follows (kv_gather) keeps them: every backend (CPU, emulated, CUDA) goes through the same entries. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../core/rng.h"
#include "press.h"

#define MERGE_EPS 1e-6 /* kvpress MergingPress's _EPS: norm clamp and the weight's denominator */
#define SIM_TILE 128   /* evicted rows per similarity GEMM */
#define SIM_SLACK 1e-4f /* fp32 cosines this close to a row's maximum are recomputed in float64 */

/* torch.lerp(a, b, w) as torch computes it (its quantile interpolates with it): the -inf gates of
 * merge_fraction give -inf or NaN thresholds exactly as there. */
static double torch_lerp(double a, double b, double w) { return w < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w); }

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b ? 1 : 0;
}

kvc_status kvc_merge_similar(const float *k, const float *v, int64_t n, int32_t d, const int64_t *keep, int64_t n_keep,
                             float threshold, float fraction, float *v_out) {
    if (!k || !v || !keep || !v_out || n < 0 || d < 1 || n_keep < 0 || n_keep > n)
        return kvc_fail(KVC_ERR_ARG, "kvc_merge_similar: bad arguments (n %lld, d %d, n_keep %lld)", (long long)n, d,
                        (long long)n_keep);
    if (!(threshold >= 0 && threshold <= 1)) return kvc_fail(KVC_ERR_ARG, "similarity_threshold must be in [0, 1], got %g", threshold);
    if (!(fraction > 0 && fraction <= 1)) return kvc_fail(KVC_ERR_ARG, "merge_fraction must be in (0, 1], got %g", fraction);
    for (int64_t i = 0; i < n_keep; i++) {
        if (keep[i] < 0 || keep[i] >= n || (i > 0 && keep[i] <= keep[i - 1]))
            return kvc_fail(KVC_ERR_ARG, "kvc_merge_similar: kept rows must be increasing and in [0, %lld)", (long long)n);
        memcpy(v_out + i * d, v + keep[i] * d, sizeof(float) * (size_t)d);
    }
    const int64_t n_evict = n - n_keep;
    if (n_evict == 0 || n_keep == 0) return KVC_OK;
    double *kn = malloc(sizeof(double) * (size_t)(n * d)), *vnorm = malloc(sizeof(double) * (size_t)n);
    double *sim = malloc(sizeof(double) * (size_t)n_evict), *sorted = malloc(sizeof(double) * (size_t)n_evict);
    double *acc = calloc((size_t)(n_keep * d), sizeof(double)), *wsum = calloc((size_t)n_keep, sizeof(double));
    int64_t *ev = malloc(sizeof(int64_t) * (size_t)n_evict), *target = malloc(sizeof(int64_t) * (size_t)n_evict);
    char *kept = calloc((size_t)n, 1);
    float *uf = malloc(sizeof(float) * (size_t)(n * d)), *ukf = malloc(sizeof(float) * (size_t)(n_keep * d));
    float *uef = malloc(sizeof(float) * SIM_TILE * (size_t)d), *tile = malloc(sizeof(float) * SIM_TILE * (size_t)n_keep);
    kvc_status st = KVC_OK;
    if (!kn || !vnorm || !sim || !sorted || !acc || !wsum || !ev || !target || !kept || !uf || !ukf || !uef || !tile) {
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: MergingPress");
        goto done;
    }
    for (int64_t r = 0; r < n; r++) { /* unit keys (norm clamped at eps) and value norms */
        double kk = 0, vv = 0;
        for (int32_t j = 0; j < d; j++) {
            kk += (double)k[r * d + j] * k[r * d + j];
            vv += (double)v[r * d + j] * v[r * d + j];
        }
        const double nk = sqrt(kk) > MERGE_EPS ? sqrt(kk) : MERGE_EPS;
        for (int32_t j = 0; j < d; j++) kn[r * d + j] = k[r * d + j] / nk;
        vnorm[r] = sqrt(vv);
    }
    for (int64_t i = 0; i < n_keep; i++) kept[keep[i]] = 1;
    int64_t e = 0;
    for (int64_t r = 0; r < n; r++)
        if (!kept[r]) ev[e++] = r;
    /* the most similar kept row (the first of equal ones): the cosines by an fp32 GEMM, tiles of evicted rows; the
     * candidates within SIM_SLACK of a row's fp32 maximum are recomputed in float64 and the largest taken, so the
     * choice is the float64 one (the fp32 error of unit vectors is far below the slack) */
    for (int64_t r = 0; r < n; r++)
        for (int32_t j = 0; j < d; j++) uf[r * d + j] = (float)kn[r * d + j];
    for (int64_t i = 0; i < n_keep; i++) memcpy(ukf + i * d, uf + keep[i] * d, sizeof(float) * (size_t)d);
    for (int64_t e0 = 0; e0 < n_evict; e0 += SIM_TILE) {
        const int64_t t = n_evict - e0 < SIM_TILE ? n_evict - e0 : SIM_TILE;
        for (int64_t i = 0; i < t; i++) memcpy(uef + i * d, uf + ev[e0 + i] * d, sizeof(float) * (size_t)d);
        kvc_host_gemm_nt(uef, d, ukf, tile, n_keep, t, n_keep, d, 0);
        for (int64_t i = 0; i < t; i++) {
            const float *row = tile + i * n_keep;
            float fmax = -INFINITY;
            for (int64_t c = 0; c < n_keep; c++) fmax = row[c] > fmax ? row[c] : fmax;
            double best = -INFINITY;
            int64_t arg = 0;
            for (int64_t c = 0; c < n_keep; c++) {
                if (!(row[c] >= fmax - SIM_SLACK)) continue;
                double dot = 0;
                for (int32_t j = 0; j < d; j++) dot += kn[ev[e0 + i] * d + j] * kn[keep[c] * d + j];
                if (dot > best) best = dot, arg = c;
            }
            sim[e0 + i] = best;
            target[e0 + i] = arg;
        }
    }
    double gate = -INFINITY; /* merge_fraction: keep the top share by similarity (torch.quantile over the gated sims) */
    int any = 0;
    for (e = 0; e < n_evict; e++) any |= sim[e] >= threshold;
    if (fraction < 1 && any) {
        for (e = 0; e < n_evict; e++) sorted[e] = sim[e] >= threshold ? sim[e] : -INFINITY;
        qsort(sorted, (size_t)n_evict, sizeof(double), cmp_double);
        const double pos = (1.0 - (double)fraction) * (double)(n_evict - 1);
        const int64_t lo = (int64_t)floor(pos), hi = (int64_t)ceil(pos);
        gate = torch_lerp(sorted[lo], sorted[hi], pos - (double)lo);
    }
    for (e = 0; e < n_evict; e++) {
        const int ok = sim[e] >= threshold && (fraction >= 1 || sim[e] >= gate); /* NaN gate: no merge */
        if (!ok) continue;
        const int64_t t = target[e], src = ev[e], dst = keep[t];
        const double w = (sim[e] > 0 ? sim[e] : 0.0) * vnorm[src] / (vnorm[src] + vnorm[dst] + MERGE_EPS);
        for (int32_t j = 0; j < d; j++) acc[t * d + j] += w * v[src * d + j];
        wsum[t] += w;
    }
    for (int64_t i = 0; i < n_keep; i++) {
        if (!(wsum[i] > 0)) continue; /* only rows that received something change */
        for (int32_t j = 0; j < d; j++) v_out[i * d + j] = (float)(((double)v[keep[i] * d + j] + acc[i * d + j]) / (1.0 + wsum[i]));
    }
done:
    free(kn); free(vnorm); free(sim); free(sorted); free(acc); free(wsum); free(ev); free(target); free(kept);
    free(uf); free(ukf); free(uef); free(tile);
    return st;
}

/* CaM's Bernoulli draw for merge candidate j of head h at a layer's `event`-th merging compression: uniform u in
 * [0, 1) from splitmix64, merged when u < p (torch.bernoulli(p) draws 1 with probability p). */
static double cam_uniform(uint64_t seed, int32_t layer, int64_t event, int32_t h, int64_t j) {
    const uint64_t key = ((uint64_t)(uint32_t)layer << 48) ^ ((uint64_t)event << 32) ^ ((uint64_t)h << 24) ^ (uint64_t)j;
    return (double)(kvc_splitmix64(seed ^ kvc_splitmix64(key)) >> 11) * 0x1.0p-53;
}

typedef struct { double s; int64_t r; } scored_row;
/* keep order: higher score first, then lower row (the engine's top-k rule) */
static int by_score_then_row(const void *x, const void *y) {
    const scored_row *a = x, *b = y;
    if (a->s != b->s) return a->s > b->s ? -1 : 1;
    return a->r < b->r ? -1 : a->r > b->r;
}
/* merge-candidate order: higher score first, then later row (kvpress flips before its stable sort) */
static int by_score_then_later(const void *x, const void *y) {
    const scored_row *a = x, *b = y;
    if (a->s != b->s) return a->s > b->s ? -1 : 1;
    return a->r > b->r ? -1 : a->r < b->r;
}
static int by_row(const void *x, const void *y) {
    const int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return a < b ? -1 : a > b;
}

kvc_status kvc_cam_merge(const float *scores, const float *attn, const float *v, int32_t Hkv, int64_t n, int32_t d,
                         int64_t target, int64_t n_merge, int32_t merge_budget, uint64_t seed, int32_t layer, int64_t event,
                         int64_t *keep, float *v_out) {
    if (!scores || !attn || !v || !keep || !v_out || Hkv < 1 || n < 1 || d < 1 || target < 1 || target > n || n_merge < 0)
        return kvc_fail(KVC_ERR_ARG, "kvc_cam_merge: bad arguments (Hkv %d, n %lld, d %d, target %lld, n_merge %lld)", Hkv,
                        (long long)n, d, (long long)target, (long long)n_merge);
    if (merge_budget < 1) return kvc_fail(KVC_ERR_ARG, "merge_budget must be positive, got %d", merge_budget);
    scored_row *rows = malloc(sizeof(scored_row) * (size_t)n);
    int64_t *cand = malloc(sizeof(int64_t) * (size_t)n);
    double *acc = calloc((size_t)(Hkv * target * d), sizeof(double));
    if (!rows || !cand || !acc) {
        free(rows); free(cand); free(acc);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: CAMPress");
    }
    for (int64_t r = 0; r < n; r++) { /* one ranking for the layer: the mean of the heads' scores */
        double m = 0;
        for (int32_t h = 0; h < Hkv; h++) m += scores[(size_t)h * n + r];
        rows[r].s = m / Hkv;
        rows[r].r = r;
    }
    qsort(rows, (size_t)n, sizeof *rows, by_score_then_row);
    for (int64_t i = 0; i < target; i++) keep[i] = rows[i].r;
    qsort(keep, (size_t)target, sizeof *keep, by_row);
    const int64_t n_evict = n - target; /* the evicted rows rows[target ..], best-scored first */
    qsort(rows + target, (size_t)n_evict, sizeof *rows, by_score_then_later);
    const int64_t m = n_merge < n_evict ? n_merge : n_evict;
    for (int64_t j = 0; j < m; j++) cand[j] = rows[target + j].r;
    qsort(cand, (size_t)m, sizeof *cand, by_row);
    for (int64_t j = 0, start = 0; j < m; j++) {
        while (start < target && keep[start] <= cand[j]) start++; /* searchsorted(keep, cand, right=True) */
        const int64_t end = start + merge_budget < target ? start + merge_budget : target, count = end - start;
        if (count == 0) continue; /* kvpress: the contribution is zeroed */
        for (int32_t h = 0; h < Hkv; h++) {
            const float *a = attn + (size_t)h * n;
            double mean = 0;
            for (int64_t i = start; i < end; i++) mean += a[keep[i]];
            mean /= (double)count;
            double p = a[cand[j]] / mean; /* 0/0 -> 0, x/0 -> 1, then [0, 1] */
            p = isnan(p) ? 0.0 : isinf(p) ? 1.0 : p < 0 ? 0.0 : p > 1 ? 1.0 : p;
            if (!(cam_uniform(seed, layer, event, h, j) < p)) continue;
            const float *src = v + ((size_t)h * n + cand[j]) * d;
            for (int64_t i = start; i < end; i++)
                for (int32_t c = 0; c < d; c++) acc[((size_t)h * target + i) * d + c] += (double)src[c] / (double)count;
        }
    }
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t i = 0; i < target; i++)
            for (int32_t c = 0; c < d; c++)
                v_out[((size_t)h * target + i) * d + c] =
                    (float)((double)v[((size_t)h * n + keep[i]) * d + c] + acc[((size_t)h * target + i) * d + c]);
    free(rows); free(cand); free(acc);
    return KVC_OK;
}

/* The merged kept values back into the store: only the rows a merge changed, every head's in one batched write
 * (kv_write_rows: one transfer on a device, not one per row). */
kvc_status kvc_merge_write_back(const kvc_layer_rows *lr, const int64_t *const *keep, const int64_t *n_keep,
                                const float *const *out, const float *const *v) {
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    int64_t total = 0, cnt[KVC_MAX_KV_HEADS] = {0};
    for (int32_t h = 0; h < Hkv; h++) total += n_keep[h];
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1));
    float *vals = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1) * (size_t)d);
    if (!rows || !vals) {
        free(rows); free(vals);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: merged values");
    }
    const int64_t *idx[KVC_MAX_KV_HEADS];
    int64_t m = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        idx[h] = rows + m;
        for (int64_t i = 0; i < n_keep[h]; i++)
            if (memcmp(out[h] + i * d, v[h] + keep[h][i] * d, sizeof(float) * (size_t)d) != 0) {
                rows[m] = keep[h][i];
                memcpy(vals + m * d, out[h] + i * d, sizeof(float) * (size_t)d);
                m++;
                cnt[h]++;
            }
    }
    const kvc_status st = m > 0 ? lr->be->kv_write_rows(lr->kv, idx, cnt, NULL, vals) : KVC_OK;
    free(rows); free(vals);
    return st;
}

/* MergingPress on a session's layer, before its compaction: the merged heads' rows to the host in one batched read,
 * the merged kept values back into their rows in one batched write, so the compaction that follows keeps them. */
kvc_status kvc_press_merge(const kvc_layer_rows *lr, const kvc_press_config *cfg, const int64_t *len,
                           const int64_t *const *keep, const int64_t *n_keep) {
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    int64_t rows[KVC_MAX_KV_HEADS], total = 0, kept = 0;
    for (int32_t h = 0; h < Hkv; h++) { /* a head that keeps all or nothing merges nothing */
        rows[h] = n_keep[h] == len[h] || n_keep[h] == 0 ? 0 : len[h];
        total += rows[h];
        kept += rows[h] ? n_keep[h] : 0;
    }
    if (total == 0) return KVC_OK;
    float *k = malloc(sizeof(float) * (size_t)(total * d)), *v = malloc(sizeof(float) * (size_t)(total * d));
    float *out = malloc(sizeof(float) * (size_t)(kept * d + 1));
    kvc_status st = k && v && out ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: MergingPress");
    if (st == KVC_OK) st = lr->be->kv_read_heads(lr->kv, NULL, rows, k, v);
    const float *vh[KVC_MAX_KV_HEADS], *oh[KVC_MAX_KV_HEADS];
    int64_t nk[KVC_MAX_KV_HEADS], at = 0, ot = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        vh[h] = v + at * d;
        oh[h] = out + ot * d;
        nk[h] = rows[h] ? n_keep[h] : 0;
        if (rows[h])
            st = kvc_merge_similar(k + at * d, v + at * d, len[h], d, keep[h], n_keep[h], cfg->merge_threshold,
                                   cfg->merge_fraction, out + ot * d);
        at += rows[h];
        ot += nk[h];
    }
    if (st == KVC_OK) st = kvc_merge_write_back(lr, keep, nk, oh, vh);
    free(k); free(v); free(out);
    return st;
}
