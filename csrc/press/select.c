/* Allocation and selection: how many rows each head keeps (uniform, PyramidKV, Ada-KV) and which
 * (top-k with ties broken by lower position). METHODS.md, "Common ground", "PyramidKV", "Ada-KV". */
#include <math.h>
#include <string.h>

#include "press.h"

int64_t kvc_n_kept_ratio(int64_t n, double cr) {
    /* kvpress compute_n_kept: int(n * (1 - cr)), at least 1 */
    int64_t k = (int64_t)((double)n * (1.0 - cr));
    return k < 1 ? 1 : k;
}

/* Python's round(): half to even, as kvpress's PyramidKV schedule uses it. */
static int64_t round_half_even(double x) {
    double r = nearbyint(x); /* default rounding mode is to-nearest-even */
    return (int64_t)r;
}

int64_t kvc_layer_budget(const kvc_press_config *p, int32_t layer, int32_t n_layers, int64_t n) {
    const double avg = p->budget > 0 ? (double)p->budget : (double)n * (1.0 - p->compression_ratio);
    if (p->budget > 0 && n <= p->budget) return n;
    if (p->allocation != KVC_ALLOC_PYRAMID) {
        int64_t k = p->budget > 0 ? p->budget : kvc_n_kept_ratio(n, p->compression_ratio);
        return k > n ? n : k;
    }
    /* PyramidKV (kvpress integer schedule): budgets fall linearly with depth from max_num to
     * min_num = (budget - w) / beta with mean budget - w, plus the window; if that schedule does
     * not fit the prompt, uniform. */
    const double w = p->window, beta = p->pyramid_beta;
    const double max_cap = w + avg;
    double min_num = (max_cap - w) / beta;
    double max_num = (max_cap - w) * 2 - min_num;
    if (max_num >= (double)n - w) {
        max_num = (double)n - w;
        min_num = (max_cap - w) * 2 - max_num;
    }
    if (!((double)n >= max_num && max_num >= min_num && min_num >= w)) {
        int64_t k = round_half_even(avg);
        return k < 1 ? 1 : (k > n ? n : k);
    }
    const double steps = n_layers > 1 ? (max_num - min_num) / (n_layers - 1) : 0.0;
    int64_t k = round_half_even(max_num - layer * steps);
    return k < 1 ? 1 : (k > n ? n : k);
}

/* ---------------------------------------------------------------------------------------------- */
/* top-k                                                                                           */

typedef struct { float s; int64_t r; int32_t h; } cand;

/* higher score first, then lower row, then lower head */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    if (x->r != y->r) return x->r < y->r ? -1 : 1;
    return (x->h > y->h) - (x->h < y->h);
}

static int row_cmp(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

void kvc_topk_rows(const float *scores, int64_t n, int64_t k, int64_t *out) {
    if (k >= n) {
        for (int64_t r = 0; r < n; r++) out[r] = r;
        return;
    }
    cand *c = malloc(sizeof(cand) * (size_t)(n > 0 ? n : 1));
    if (!c) { /* degrade to keeping the most recent rows rather than failing mid-prefill */
        for (int64_t i = 0; i < k; i++) out[i] = n - k + i;
        return;
    }
    for (int64_t r = 0; r < n; r++) c[r] = (cand){isnan(scores[r]) ? -INFINITY : scores[r], r, 0};
    qsort(c, (size_t)n, sizeof(cand), cand_cmp);
    for (int64_t i = 0; i < k; i++) out[i] = c[i].r;
    qsort(out, (size_t)k, sizeof(int64_t), row_cmp);
    free(c);
}

/* alpha_safeguard travels as a float (0.7f = 0.69999998...), which would make int(10 * alpha) = 6
 * where kvpress (Python doubles) gets 7: read it back as the decimal the user wrote (6 places). */
static double safeguard_alpha(float a) { return nearbyint((double)a * 1e6) / 1e6; }

/* Ada-KV: head-wise budgets from a layer-wide top-k. `n_kept` is the average per-head budget
 * (window inside), `w` the protected window at the end of every head. */
static kvc_status adakv_select(const kvc_press_config *p, int32_t n_kv, const int64_t *len,
                               const float *const *scores, int32_t w, int64_t n_kept,
                               int64_t **keep, int64_t *n_keep) {
    int64_t total = 0;
    for (int32_t h = 0; h < n_kv; h++) total += len[h];
    cand *c = malloc(sizeof(cand) * (size_t)(total > 0 ? total : 1));
    char *chosen = calloc((size_t)(total > 0 ? total : 1), 1);
    int64_t *off = malloc(sizeof(int64_t) * (size_t)n_kv);
    if (!c || !chosen || !off) {
        free(c);
        free(chosen);
        free(off);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: Ada-KV selection");
    }
    int64_t o = 0;
    for (int32_t h = 0; h < n_kv; h++) {
        off[h] = o;
        o += len[h];
    }
    if (p->safeguard == KVC_SAFEGUARD_PROTECT) {
        /* kvpress AdaKVPress: each head's top n_safe protected (window included in that ranking,
         * since its scores are max + 1), then the best of the rest layer-wide up to n_kv * n_kept. */
        const double alpha = safeguard_alpha(p->alpha_safeguard);
        int64_t n_safe = (int64_t)((double)n_kept * alpha);
        if (alpha > 0 && n_kept > 0 && n_safe < 1) n_safe = 1;
        int64_t protected_total = 0;
        int64_t *tmp = malloc(sizeof(int64_t) * (size_t)(n_safe > 0 ? n_safe : 1));
        if (!tmp) {
            free(c); free(chosen); free(off);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: Ada-KV selection");
        }
        for (int32_t h = 0; h < n_kv; h++) {
            const int64_t k = n_safe < len[h] ? n_safe : len[h];
            kvc_topk_rows(scores[h], len[h], k, tmp);
            for (int64_t i = 0; i < k; i++) chosen[off[h] + tmp[i]] = 1;
            protected_total += k;
        }
        free(tmp);
        int64_t m = 0;
        for (int32_t h = 0; h < n_kv; h++)
            for (int64_t r = 0; r < len[h]; r++)
                if (!chosen[off[h] + r]) c[m++] = (cand){scores[h][r], r, h};
        qsort(c, (size_t)m, sizeof(cand), cand_cmp);
        int64_t rest = (int64_t)n_kv * n_kept - protected_total;
        for (int64_t i = 0; i < rest && i < m; i++) chosen[off[c[i].h] + c[i].r] = 1;
    } else {
        /* official Ada-KV: global top n_kv * Bp over past rows gives f_h; each head keeps its own top
         * cap_h = round(f_h (1 - a) + floor(Bp a)) past rows, plus the window. */
        const int64_t Bp = n_kept - w > 0 ? n_kept - w : 0;
        const double alpha = safeguard_alpha(p->alpha_safeguard);
        int64_t m = 0;
        for (int32_t h = 0; h < n_kv; h++)
            for (int64_t r = 0; r < len[h] - w; r++) c[m++] = (cand){scores[h][r], r, h};
        qsort(c, (size_t)m, sizeof(cand), cand_cmp);
        int64_t *f = calloc((size_t)n_kv, sizeof(int64_t));
        int64_t *tmp = malloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1));
        if (!f || !tmp) {
            free(f); free(tmp); free(c); free(chosen); free(off);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: Ada-KV selection");
        }
        for (int64_t i = 0; i < (int64_t)n_kv * Bp && i < m; i++) f[c[i].h]++;
        for (int32_t h = 0; h < n_kv; h++) {
            const int64_t n_past = len[h] - w;
            int64_t cap = (int64_t)llround((double)f[h] * (1.0 - alpha) + floor((double)Bp * alpha));
            if (cap > n_past) cap = n_past;
            if (cap < 0) cap = 0;
            kvc_topk_rows(scores[h], n_past, cap, tmp);
            for (int64_t i = 0; i < cap; i++) chosen[off[h] + tmp[i]] = 1;
            for (int64_t r = n_past; r < len[h]; r++) chosen[off[h] + r] = 1;
        }
        free(f);
        free(tmp);
    }
    for (int32_t h = 0; h < n_kv; h++) {
        int64_t k = 0;
        for (int64_t r = 0; r < len[h]; r++)
            if (chosen[off[h] + r]) keep[h][k++] = r;
        n_keep[h] = k;
    }
    free(c);
    free(chosen);
    free(off);
    return KVC_OK;
}

/* Given a layer total (window rows included), the best past rows across every head of the layer,
 * plus each head's window (TADA: "like Ada-KV without safeguard"). */
static kvc_status layer_total_select(int32_t n_kv, const int64_t *len, const float *const *scores, int32_t w,
                                     int64_t total, int64_t **keep, int64_t *n_keep) {
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

kvc_status kvc_press_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv,
                            const int64_t *len, const float *const *scores, int32_t window, int64_t layer_total,
                            int64_t **keep, int64_t *n_keep) {
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
    const int chunk_fallback = p->budget == 0 && p->allocation == KVC_ALLOC_UNIFORM && len[0] < p->chunk_length;
    if (p->chunk_length > 0 && !chunk_fallback) { /* shorter than one chunk: per-head tokens, as kvpress */
        for (int32_t h = 1; h < n_kv; h++)
            if (len[h] != len[0]) return kvc_fail(KVC_ERR_ARG, "ChunkKV needs every head of a layer to hold the same tokens");
        KVC_TRY(kvc_chunk_select(p, layer, n_layers, n_kv, len[0], scores, window, keep[0], &n_keep[0]));
        for (int32_t h = 1; h < n_kv; h++) {
            memcpy(keep[h], keep[0], sizeof(int64_t) * (size_t)n_keep[0]);
            n_keep[h] = n_keep[0];
        }
        return KVC_OK;
    }
    for (int32_t h = 0; h < n_kv; h++) {
        const int64_t k = kvc_layer_budget(p, layer, n_layers, len[h]);
        kvc_topk_rows(scores[h], len[h], k, keep[h]);
        n_keep[h] = k < len[h] ? k : len[h];
    }
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* ChunkKV (ChunkKV-semantic-chunks.tex, Algorithm 1; kvpress ChunkKVPress)                        */

kvc_status kvc_chunk_select(const kvc_press_config *p, int32_t layer, int32_t n_layers, int32_t n_kv, int64_t len,
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
    kvc_topk_rows(cs, n_chunks, k_chunks, top);
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
