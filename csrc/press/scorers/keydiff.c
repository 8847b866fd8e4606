/* KeyDiff (Park et al., 2025; kvpress KeyDiffPress): -cos(k, anchor), anchor = the mean over the head's rows
 * of k / ||k||. On the host, in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

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

static kvc_status keydiff_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                 const int64_t *len, float *const *scores) {
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    float *k[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = kvc_press_layer_rows(lr, len, 0, k, NULL, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) keydiff_head(k[h], len[h], d, scores[h]);
    kvc_free(block);
    return st;
}

static const char *const params[] = {NULL};

static const kvc_scorer_i keydiff_scorer = {
    .name = "keydiff",
    .title = "KeyDiff",
    .code = KVC_SCORE_KEYDIFF,
    .traits = KVC_SCORER_HOST | KVC_SCORER_CHUNKABLE,
    .params = params,
    .check = NULL,
    .host = keydiff_scores,
    .select = NULL,
    .doc = "-cos(k, mean of the normalised keys) (KeyDiff, Park et al. 2025)",
};
KVC_REGISTER_SCORER(keydiff_scorer);
