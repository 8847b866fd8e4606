/* Allocation and selection (docs/METHODS.md, "Common ground", "PyramidKV", "Ada-KV", "ChunkKV", "EDIE
 * scoring and TADA allocation"): how many rows each head keeps and which, from a layer's host scores.
 * Ties go to the lower row; kept rows stay in position order. Also TADA's layer capacities. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

/* A row of some head, for layer-wide rankings. */
typedef struct {
    float s;
    int64_t r;
    int32_t h;
} cand;

/* higher score first, then lower row, then lower head */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    if (x->r != y->r) return x->r < y->r ? -1 : 1;
    return (x->h > y->h) - (x->h < y->h);
}

/* alpha_safeguard travels as a float (0.7f = 0.69999998...), which would make int(10 * alpha) = 6
 * where kvpress (Python doubles) gets 7: read it back as the decimal the user wrote (6 places). */
static double safeguard_alpha(float a) { return nearbyint((double)a * 1e6) / 1e6; }

/* Ada-KV: head-wise budgets from a layer-wide top-k. `n_kept` is the average per-head budget
 * (window inside), `w` the protected window at the end of every head. */
static kvc_status adakv_select(const kvc_press_config *p, int32_t n_kv, const int64_t *len,
                               const float *const *scores, int32_t w, int64_t n_kept,
                               int64_t *const *keep, int64_t *n_keep) {
    int64_t total = 0;
    for (int32_t h = 0; h < n_kv; h++) total += len[h];
    const size_t nt = (size_t)(total > 0 ? total : 1);
    cand *c = malloc(sizeof(cand) * nt);
    char *chosen = calloc(nt, 1);
    int64_t *off = malloc(sizeof(int64_t) * (size_t)n_kv), *tmp = malloc(sizeof(int64_t) * nt);
    int64_t *f = calloc((size_t)n_kv, sizeof(int64_t));
    kvc_status st = (!c || !chosen || !off || !tmp || !f) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: Ada-KV selection") : KVC_OK;
    int64_t o = 0;
    for (int32_t h = 0; h < n_kv && st == KVC_OK; h++) {
        off[h] = o;
        o += len[h];
    }
    const double alpha = safeguard_alpha(p->alpha_safeguard);
    if (st == KVC_OK && p->safeguard == KVC_SAFEGUARD_PROTECT) {
        /* kvpress AdaKVPress: each head's top n_safe protected (window included in that ranking,
         * since its scores are max + 1), then the best of the rest layer-wide up to n_kv * n_kept. */
        int64_t n_safe = (int64_t)((double)n_kept * alpha);
        if (alpha > 0 && n_kept > 0 && n_safe < 1) n_safe = 1;
        int64_t protected_total = 0;
        for (int32_t h = 0; h < n_kv && st == KVC_OK; h++) {
            const int64_t k = n_safe < len[h] ? n_safe : len[h];
            st = kvc_host_topk_rows(scores[h], len[h], k, tmp);
            for (int64_t i = 0; st == KVC_OK && i < k; i++) chosen[off[h] + tmp[i]] = 1;
            protected_total += k;
        }
        int64_t m = 0;
        for (int32_t h = 0; h < n_kv && st == KVC_OK; h++)
            for (int64_t r = 0; r < len[h]; r++)
                if (!chosen[off[h] + r]) c[m++] = (cand){scores[h][r], r, h};
        if (st == KVC_OK) {
            qsort(c, (size_t)m, sizeof(cand), cand_cmp);
            const int64_t rest = (int64_t)n_kv * n_kept - protected_total;
            for (int64_t i = 0; i < rest && i < m; i++) chosen[off[c[i].h] + c[i].r] = 1;
        }
    } else if (st == KVC_OK) {
        /* official Ada-KV: global top n_kv * Bp over past rows gives f_h; each head keeps its own top
         * cap_h = round(f_h (1 - a) + floor(Bp a)) past rows, plus the window. */
        const int64_t Bp = n_kept - w > 0 ? n_kept - w : 0;
        int64_t m = 0;
        for (int32_t h = 0; h < n_kv; h++)
            for (int64_t r = 0; r < len[h] - w; r++) c[m++] = (cand){scores[h][r], r, h};
        qsort(c, (size_t)m, sizeof(cand), cand_cmp);
        for (int64_t i = 0; i < (int64_t)n_kv * Bp && i < m; i++) f[c[i].h]++;
        for (int32_t h = 0; h < n_kv && st == KVC_OK; h++) {
            const int64_t n_past = len[h] - w;
            int64_t cap = (int64_t)llround((double)f[h] * (1.0 - alpha) + floor((double)Bp * alpha));
            if (cap > n_past) cap = n_past;
            if (cap < 0) cap = 0;
            st = kvc_host_topk_rows(scores[h], n_past, cap, tmp);
            for (int64_t i = 0; st == KVC_OK && i < cap; i++) chosen[off[h] + tmp[i]] = 1;
            for (int64_t r = n_past; r < len[h]; r++) chosen[off[h] + r] = 1;
        }
    }
    for (int32_t h = 0; h < n_kv && st == KVC_OK; h++) {
        int64_t k = 0;
        for (int64_t r = 0; r < len[h]; r++)
            if (chosen[off[h] + r]) keep[h][k++] = r;
        n_keep[h] = k;
    }
    free(c);
    free(chosen);
    free(off);
    free(tmp);
    free(f);
    return st;
}

/* Given a layer total (window rows included), the best past rows across every head of the layer,
 * plus each head's window (TADA: "like Ada-KV without safeguard"). */
static kvc_status layer_total_select(int32_t n_kv, const int64_t *len, const float *const *scores, int32_t w,
                                     int64_t total, int64_t *const *keep, int64_t *n_keep) {
    int64_t all = 0, n_past_all = 0;
    for (int32_t h = 0; h < n_kv; h++) {
        all += len[h];
        n_past_all += len[h] - w;
    }
    if (total >= all) {
        for (int32_t h = 0; h < n_kv; h++) {
            for (int64_t r = 0; r < len[h]; r++) keep[h][r] = r;
            n_keep[h] = len[h];
        }
        return KVC_OK;
    }
    int64_t past_budget = total - (int64_t)n_kv * w;
    if (past_budget < 0) past_budget = 0;
    cand *c = malloc(sizeof(cand) * (size_t)(n_past_all > 0 ? n_past_all : 1));
    char **chosen = calloc((size_t)n_kv, sizeof(char *));
    kvc_status st = (!c || !chosen) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: layer selection") : KVC_OK;
    for (int32_t h = 0; h < n_kv && st == KVC_OK; h++)
        if (!(chosen[h] = calloc((size_t)(len[h] > 0 ? len[h] : 1), 1))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory");
    if (st == KVC_OK) {
        int64_t m = 0;
        for (int32_t h = 0; h < n_kv; h++)
            for (int64_t r = 0; r < len[h] - w; r++) c[m++] = (cand){scores[h][r], r, h};
        qsort(c, (size_t)m, sizeof(cand), cand_cmp);
        for (int64_t i = 0; i < past_budget && i < m; i++) chosen[c[i].h][c[i].r] = 1;
        for (int32_t h = 0; h < n_kv; h++) {
            int64_t k = 0;
            for (int64_t r = 0; r < len[h]; r++)
                if (chosen[h][r] || r >= len[h] - w) keep[h][k++] = r;
            n_keep[h] = k;
        }
    }
    if (chosen)
        for (int32_t h = 0; h < n_kv; h++) free(chosen[h]);
    free(chosen);
    free(c);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* ChunkKV (ChunkKV-semantic-chunks.tex, Algorithm 1; kvpress ChunkKVPress): one selection of whole   */
/* chunks shared by every head (scores summed over heads); keep_rows receives sorted rows.         */

static kvc_status chunk_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv, int64_t len,
                               const float *const *scores, int32_t window, int64_t *keep_rows, int64_t *n_keep) {
    const int64_t c = p->chunk_length;
    /* ratio form chunks the whole cache (the window's max+1 scores pull its chunks in, as in kvpress);
     * budget form chunks the past and adds the window: floor((B - w) / c) chunks + w tokens. */
    const int ratio_form = p->budget == 0 && p->allocation == KVC_ALLOC_UNIFORM;
    const int64_t span = ratio_form ? len : len - window;
    const int64_t n_full = span / c, rem = span % c, n_chunks = n_full + (rem > 0);
    int64_t k_chunks;
    if (ratio_form) {
        k_chunks = (int64_t)((double)n_chunks * (1.0 - p->compression_ratio));
        if (k_chunks < 1) k_chunks = 1;
    } else {
        const int64_t k = kvc_layer_budget(p, layer, n_layers, len);
        k_chunks = (k - window) / c;
        if (k_chunks < 0) k_chunks = 0;
    }
    if (k_chunks > n_chunks) k_chunks = n_chunks;
    float *cs = calloc((size_t)(n_chunks > 0 ? n_chunks : 1), sizeof(float));
    int64_t *top = malloc(sizeof(int64_t) * (size_t)(n_chunks > 0 ? n_chunks : 1));
    if (!cs || !top) {
        free(cs);
        free(top);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: ChunkKV");
    }
    for (int64_t ci = 0; ci < n_chunks; ci++) {
        const int64_t lo = ci * c, hi = lo + c < span ? lo + c : span;
        double sum = 0;
        for (int64_t r = lo; r < hi; r++)
            for (int32_t h = 0; h < n_kv; h++) sum += scores[h][r];
        cs[ci] = (float)(sum / (double)(hi - lo));
    }
    kvc_status st = kvc_host_topk_rows(cs, n_chunks, k_chunks, top);
    if (st != KVC_OK) {
        free(cs);
        free(top);
        return st;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < k_chunks; i++) {
        const int64_t lo = top[i] * c, hi = lo + c < span ? lo + c : span;
        for (int64_t r = lo; r < hi; r++) keep_rows[m++] = r;
    }
    for (int64_t r = span; r < len; r++) keep_rows[m++] = r; /* the window (budget form) */
    *n_keep = m;
    free(cs);
    free(top);
    return KVC_OK;
}

kvc_status kvc_press_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv,
                            const int64_t *len, const float *const *scores, int32_t window, int64_t layer_total,
                            int64_t *const *keep, int64_t *n_keep) {
    if (p->allocation == KVC_ALLOC_LAYER) {
        if (layer_total < 0)
            return kvc_fail(KVC_ERR_ARG, "layer %d has no budget: set the per-layer totals first (kvc_session_set_layer_budgets)", layer);
        return layer_total_select(n_kv, len, scores, window, layer_total, keep, n_keep);
    }
    if (p->allocation == KVC_ALLOC_ADAKV) {
        int64_t n = 0;
        for (int32_t h = 0; h < n_kv; h++) n = len[h] > n ? len[h] : n;
        const int64_t n_kept = kvc_layer_budget(p, layer, n_layers, n);
        if (n_kept >= n) { /* nothing to evict */
            for (int32_t h = 0; h < n_kv; h++) {
                for (int64_t r = 0; r < len[h]; r++) keep[h][r] = r;
                n_keep[h] = len[h];
            }
            return KVC_OK;
        }
        return adakv_select(p, n_kv, len, scores, window, n_kept, keep, n_keep);
    }
    const int chunk_fallback = p->budget == 0 && p->allocation == KVC_ALLOC_UNIFORM && len[0] < p->chunk_length &&
                               p->low_entropy_chunk == 0;
    if (p->chunk_length > 0 && !chunk_fallback) { /* shorter than one chunk: per-head tokens, as kvpress */
        for (int32_t h = 1; h < n_kv; h++)
            if (len[h] != len[0]) return kvc_fail(KVC_ERR_ARG, "ChunkKV needs every head of a layer to hold the same tokens");
        if (p->low_entropy_chunk > 0) /* EntropyGatedChunkKV: a token budget over the whole cache */
            KVC_TRY(kvc_entropy_chunk_select(p, n_kv, len[0], kvc_layer_budget(p, layer, n_layers, len[0]), scores, keep[0],
                                             &n_keep[0]));
        else
            KVC_TRY(chunk_select(p, layer, n_layers, n_kv, len[0], scores, window, keep[0], &n_keep[0]));
        for (int32_t h = 1; h < n_kv; h++) {
            memcpy(keep[h], keep[0], sizeof(int64_t) * (size_t)n_keep[0]);
            n_keep[h] = n_keep[0];
        }
        return KVC_OK;
    }
    for (int32_t h = 0; h < n_kv; h++) {
        const int64_t k = kvc_layer_budget(p, layer, n_layers, len[h]);
        KVC_TRY(kvc_host_topk_rows(scores[h], len[h], k, keep[h]));
        n_keep[h] = k < len[h] ? k : len[h];
    }
    return KVC_OK;
}

int kvc_press_per_head_topk(const kvc_press_config *p) {
    return !p->drop_window && p->chunk_length == 0 &&
           (p->allocation == KVC_ALLOC_UNIFORM || p->allocation == KVC_ALLOC_PYRAMID);
}


/* ---------------------------------------------------------------------------------------------- */
/* TADA's layer capacities (EDIE-TADA-error-driven-eviction.txt; docs/METHODS.md "EDIE scoring and TADA")  */

static double clipped_sum(const double *w, int32_t L, double lam, double lo, double hi) {
    double s = 0;
    for (int32_t l = 0; l < L; l++) {
        const double x = lam * w[l];
        s += x < lo ? lo : x > hi ? hi : x;
    }
    return s;
}

kvc_status kvc_tada_allocate(const double *weights, int32_t L, int64_t total, int64_t lo, int64_t hi, int64_t *out) {
    if (!weights || !out || L < 1) return kvc_fail(KVC_ERR_ARG, "kvc_tada_allocate: need weights and out for L >= 1 layers");
    if (lo < 0 || hi < lo) return kvc_fail(KVC_ERR_ARG, "kvc_tada_allocate: bounds [%lld, %lld] are empty",
                                           (long long)lo, (long long)hi);
    double *w = malloc(sizeof(double) * (size_t)L), *share = malloc(sizeof(double) * (size_t)L);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)L);
    if (!w || !share || !order) {
        free(w); free(share); free(order);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: TADA allocation");
    }
    /* the total the bounds allow */
    if (total < (int64_t)L * lo) total = (int64_t)L * lo;
    if (total > (int64_t)L * hi) total = (int64_t)L * hi;
    double sum = 0;
    for (int32_t l = 0; l < L; l++) {
        w[l] = weights[l] > 0 && isfinite(weights[l]) ? weights[l] : 0.0;
        sum += w[l];
    }
    for (int32_t l = 0; l < L; l++) w[l] = sum > 0 ? w[l] / sum : 1.0 / L;
    /* budgets clip(lam w, lo, hi) with lam found by bisection (the sum is monotone in lam) */
    double a = 0.0, b = 1.0;
    while (clipped_sum(w, L, b, (double)lo, (double)hi) < (double)total && b < 1e300) b *= 2;
    for (int it = 0; it < 200; it++) {
        const double mid = (a + b) / 2;
        if (clipped_sum(w, L, mid, (double)lo, (double)hi) < (double)total) a = mid;
        else b = mid;
    }
    int64_t given = 0;
    for (int32_t l = 0; l < L; l++) {
        const double x = b * w[l];
        share[l] = x < lo ? (double)lo : x > hi ? (double)hi : x;
        out[l] = (int64_t)floor(share[l]);
        given += out[l];
        order[l] = l;
    }
    /* the rest by largest remainders (stable: the lower layer first among equals), within the bounds */
    for (int32_t i = 1; i < L; i++)
        for (int32_t j = i; j > 0; j--) {
            const double rj = share[order[j]] - (double)out[order[j]], rp = share[order[j - 1]] - (double)out[order[j - 1]];
            if (rj > rp) {
                const int32_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            } else {
                break;
            }
        }
    int64_t rest = total - given;
    while (rest > 0) {
        int moved = 0;
        for (int32_t i = 0; i < L && rest > 0; i++)
            if (out[order[i]] < hi) {
                out[order[i]]++;
                rest--;
                moved = 1;
            }
        if (!moved) break;
    }
    while (rest < 0) { /* the shares summed slightly above the total: take back from the largest */
        int32_t best = -1;
        for (int32_t l = 0; l < L; l++)
            if (out[l] > lo && (best < 0 || out[l] > out[best])) best = l;
        if (best < 0) break;
        out[best]--;
        rest++;
    }
    free(w);
    free(share);
    free(order);
    return KVC_OK;
}
