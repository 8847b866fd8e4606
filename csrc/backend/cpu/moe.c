/* The mixture-of-experts kernels of a host backend (core/backend.h, table version 7): routing, the gather of the
 * rows an expert runs on, and the weighted sum of the experts' outputs into the residual stream. They work on f32
 * storage in place and on bf16 storage (the emulated device) through converted copies, as the other entries. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "host.h"

/* a ranks before b: higher p, then the lower expert; NaN below every number */
static int ranks_before(double pa, int32_t a, double pb, int32_t b) {
    if (isnan(pa) || isnan(pb)) return isnan(pb) && (!isnan(pa) || a < b);
    return pa > pb || (pa == pb && a < b);
}

/* One row: the softmax in double (rounded once at the end), the top k by repeated selection (k is small). */
static void route_row(const float *logits, int32_t E, int32_t k, int32_t norm, double *p, char *taken, int32_t *ids,
                      float *w) {
    double mx = -INFINITY, sum = 0;
    for (int32_t e = 0; e < E; e++)
        if (logits[e] > mx) mx = logits[e];
    for (int32_t e = 0; e < E; e++) sum += p[e] = exp((double)logits[e] - mx);
    for (int32_t e = 0; e < E; e++) p[e] /= sum;
    memset(taken, 0, (size_t)E);
    double chosen = 0;
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || ranks_before(p[e], e, p[best], best))) best = e;
        taken[best] = 1;
        ids[j] = best;
        chosen += p[best];
    }
    for (int32_t j = 0; j < k; j++) w[j] = (float)(norm ? p[ids[j]] / chosen : p[ids[j]]);
}

kvc_status kvc_host_moe_route_v(kvc_view logits, int64_t n, int32_t E, int32_t k, int32_t norm, kvc_view ids, kvc_view w) {
    if (logits.buf->dtype != KVC_F32 || ids.buf->dtype != KVC_I32 || w.buf->dtype != KVC_F32)
        return kvc_fail(KVC_ERR_INTERNAL, "moe_route: logits and weights must be f32, ids i32");
    if (E < 1 || k < 1 || k > E) return kvc_fail(KVC_ERR_INTERNAL, "moe_route: %d of %d experts", k, E);
    double *p = malloc(sizeof(double) * (size_t)E);
    char *taken = malloc((size_t)E);
    if (!p || !taken) {
        free(p);
        free(taken);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: routing");
    }
    for (int64_t r = 0; r < n; r++)
        route_row((const float *)kvc_hbuf_at(logits, r, 0), E, k, norm, p, taken, (int32_t *)kvc_hbuf_at(ids, r, 0),
                  (float *)kvc_hbuf_at(w, r, 0));
    free(p);
    free(taken);
    return KVC_OK;
}

/* A plain copy of each row in the buffers' own dtype: bf16 rows stay exactly as stored. */
kvc_status kvc_host_gather_rows_v(kvc_view src, kvc_view idx, int64_t n, int64_t D, kvc_view dst) {
    if (src.buf->dtype != dst.buf->dtype || kvc_dtype_is_wtype(src.buf->dtype) || idx.buf->dtype != KVC_I32)
        return kvc_fail(KVC_ERR_INTERNAL, "gather_rows: rows of one activation dtype, i32 indices");
    const int32_t *ix = (const int32_t *)kvc_hbuf_at(idx, 0, 0);
    const size_t bytes = (size_t)D * kvc_dtype_size(src.buf->dtype);
    for (int64_t i = 0; i < n; i++) {
        if (ix[i] < 0) return kvc_fail(KVC_ERR_INTERNAL, "gather_rows: row index %d", ix[i]);
        memcpy(kvc_hbuf_at(dst, i, 0), kvc_hbuf_at(src, ix[i], 0), bytes);
    }
    return KVC_OK;
}

kvc_status kvc_host_moe_combine_v(kvc_view x, kvc_view y, kvc_view w, kvc_view pos, int64_t n, int32_t k, int64_t D) {
    if (x.buf->dtype != KVC_F32 || w.buf->dtype != KVC_F32 || pos.buf->dtype != KVC_I32)
        return kvc_fail(KVC_ERR_INTERNAL, "moe_combine: x and w must be f32, pos i32");
    for (int64_t r = 0; r < n; r++)
        for (int32_t j = 0; j < k; j++) {
            const int32_t p = ((const int32_t *)kvc_hbuf_at(pos, r, 0))[j];
            if (p < 0 || p >= n * k) return kvc_fail(KVC_ERR_INTERNAL, "moe_combine: row %d of %lld", p, (long long)(n * k));
        }
    kvc_frows Y;
    KVC_TRY(kvc_frows_get(y, n * k, D, 1, &Y));
    const int par = n > 1 && n * D >= 65536 && !omp_in_parallel();
    int nomem = 0;
#pragma omp parallel num_threads(kvc_cpu_threads()) if (par)
    {
        float *acc = malloc(sizeof(float) * (size_t)D); /* the weighted sum of a row, then added once */
        if (!acc) {
#pragma omp atomic write
            nomem = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!acc) continue;
            const float *wr = (const float *)kvc_hbuf_at(w, r, 0);
            const int32_t *pr = (const int32_t *)kvc_hbuf_at(pos, r, 0);
            for (int32_t j = 0; j < k; j++) {
                const float *yr = Y.p + (int64_t)pr[j] * Y.ld, wj = wr[j];
                if (j == 0)
                    for (int64_t c = 0; c < D; c++) acc[c] = wj * yr[c];
                else
                    for (int64_t c = 0; c < D; c++) acc[c] += wj * yr[c];
            }
            float *xr = (float *)kvc_hbuf_at(x, r, 0);
            for (int64_t c = 0; c < D; c++) xr[c] += acc[c];
        }
        free(acc);
    }
    kvc_frows_drop(&Y);
    return nomem ? kvc_fail(KVC_ERR_NOMEM, "out of memory: expert outputs") : KVC_OK;
}
