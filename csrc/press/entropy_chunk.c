/* EntropyGatedChunkKV (kvpress EntropyGatedChunkKVPress, an extension of ChunkKV, Liu et al., 2025): ChunkKV
 * keeps or drops whole chunks; here a chunk whose importance comes from a few tokens keeps only those.
 * On the layer's token scores summed over its KV heads (one selection shared by the heads, as ChunkKV):
 *   chunk score = mean of its tokens; chunk entropy = the normalised entropy of its tokens' scores as a
 *   distribution (shifted by the minimum when one is negative; p = s / (sum + 1e-8),
 *   H = -sum p log(p + 1e-8) / log(rows), clamped to [0, 1]; a one-row chunk has 0);
 *   a chunk is spiky when its score >= the median chunk score and its entropy < the median entropy
 *   (medians as torch.median: the lower middle value).
 * Budget B = the uniform n_kept in tokens. Chunks in decreasing score take min(rows, B left) tokens, a spiky
 * one at most low_entropy_chunk of them (its top scores), until B is spent; what reducing spiky chunks left
 * unspent goes to the best remaining tokens. Ties: the lower chunk, the lower row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

#define ENTROPY_EPS 1e-8

/* the normalised entropy of rows scores (kvpress's formula for a full chunk and for the tail) */
static double chunk_entropy(const double *s, int64_t rows) {
    if (rows <= 1) return 0.0;
    double mn = s[0], sum = 0, h = 0;
    for (int64_t r = 1; r < rows; r++) mn = fmin(mn, s[r]);
    const double shift = mn < 0 ? mn : 0.0;
    for (int64_t r = 0; r < rows; r++) sum += s[r] - shift;
    for (int64_t r = 0; r < rows; r++) {
        const double p = (s[r] - shift) / (sum + ENTROPY_EPS);
        h -= p * log(p + ENTROPY_EPS);
    }
    h /= log((double)rows);
    return h < 0 ? 0.0 : h > 1 ? 1.0 : h;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* torch.median: the lower of the two middle values */
static double lower_median(const double *v, int64_t m, double *tmp) {
    memcpy(tmp, v, sizeof(double) * (size_t)m);
    qsort(tmp, (size_t)m, sizeof(double), cmp_double);
    return tmp[(m - 1) / 2];
}

/* top k of the token scores s[lo, hi) (higher first, then lower row) marked in keep */
static kvc_status keep_top(const double *s, int64_t lo, int64_t hi, int64_t k, char *keep, float *f, int64_t *idx) {
    for (int64_t r = lo; r < hi; r++) f[r - lo] = (float)s[r];
    KVC_TRY(kvc_host_topk_rows(f, hi - lo, k, idx));
    for (int64_t j = 0; j < k; j++) keep[lo + idx[j]] = 1;
    return KVC_OK;
}

kvc_status kvc_entropy_chunk_select(const kvc_press_config *p, int32_t n_kv, int64_t n, int64_t budget,
                                    const float *const *scores, int64_t *keep_rows, int64_t *n_keep) {
    const int64_t c = p->chunk_length;
    if (c < 1) return kvc_fail(KVC_ERR_ARG, "EntropyGatedChunkKV: chunk_length must be >= 1, got %lld", (long long)c);
    if (n == 0) { /* nothing to choose from (and no median of no chunks) */
        *n_keep = 0;
        return KVC_OK;
    }
    const int64_t n_chunks = (n + c - 1) / c;
    double *s = malloc(sizeof(double) * (size_t)n), *cs = malloc(sizeof(double) * (size_t)n_chunks);
    double *ce = malloc(sizeof(double) * (size_t)n_chunks), *tmp = malloc(sizeof(double) * (size_t)n_chunks);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)n_chunks), *idx = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *top = malloc(sizeof(int64_t) * (size_t)n);
    float *f = malloc(sizeof(float) * (size_t)n);
    char *keep = calloc((size_t)n, 1);
    kvc_status st = s && cs && ce && tmp && order && idx && top && f && keep
                        ? KVC_OK
                        : kvc_fail(KVC_ERR_NOMEM, "out of memory: EntropyGatedChunkKV");
    if (st == KVC_OK) {
        for (int64_t r = 0; r < n; r++) {
            s[r] = 0;
            for (int32_t h = 0; h < n_kv; h++) s[r] += scores[h][r];
        }
        for (int64_t i = 0; i < n_chunks; i++) {
            const int64_t lo = i * c, rows = lo + c < n ? c : n - lo;
            double sum = 0;
            for (int64_t r = lo; r < lo + rows; r++) sum += s[r];
            cs[i] = sum / (double)rows;
            ce[i] = chunk_entropy(s + lo, rows);
        }
        const double score_med = lower_median(cs, n_chunks, tmp), entropy_med = lower_median(ce, n_chunks, tmp);
        /* chunks by decreasing score (ties: the lower chunk) */
        for (int64_t i = 0; i < n_chunks; i++) order[i] = i;
        for (int64_t i = 1; i < n_chunks; i++) /* insertion sort on the double scores: n / c chunks */
            for (int64_t j = i; j > 0 && cs[order[j]] > cs[order[j - 1]]; j--) {
                const int64_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        for (int64_t oi = 0; oi < n_chunks && budget > 0 && st == KVC_OK; oi++) {
            const int64_t i = order[oi], lo = i * c, hi = lo + c < n ? lo + c : n;
            int64_t k = hi - lo < budget ? hi - lo : budget;
            if (cs[i] >= score_med && ce[i] < entropy_med && k > p->low_entropy_chunk) k = p->low_entropy_chunk;
            if (k == hi - lo)
                memset(keep + lo, 1, (size_t)k);
            else
                st = keep_top(s, lo, hi, k, keep, f, idx);
            budget -= k;
        }
        if (budget > 0 && st == KVC_OK) { /* the rest of the budget: the best tokens not kept yet */
            int64_t m = 0;
            for (int64_t r = 0; r < n; r++)
                if (!keep[r]) {
                    idx[m] = r;
                    f[m++] = (float)s[r];
                }
            const int64_t add = budget < m ? budget : m;
            st = kvc_host_topk_rows(f, m, add, top);
            for (int64_t j = 0; j < add && st == KVC_OK; j++) keep[idx[top[j]]] = 1;
        }
        int64_t k = 0;
        for (int64_t r = 0; r < n && st == KVC_OK; r++)
            if (keep[r]) keep_rows[k++] = r;
        *n_keep = k;
    }
    free(s);
    free(cs);
    free(ce);
    free(tmp);
    free(order);
    free(idx);
    free(top);
    free(f);
    free(keep);
    return st;
}
