/* core/hostmath.h on the CPU backend's kernels. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/backend.h" /* kvc_softcap */
#include "../../core/hostmath.h"
#include "cpu.h"

#define KC_NN 128 /* rows of B per pass of the microkernel in kvc_host_gemm_nn (KC x NR floats: 16 KB, L1) */

static int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

int kvc_host_threads(void) { return kvc_cpu_threads(); }

void kvc_host_gemm_nt(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      int accumulate) {
    kvc_cpu_gemm(a, lda, b, c, ldc, m, n, k, accumulate);
}

void kvc_host_gemm_nn(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m,
                      int64_t n, int64_t k, int accumulate) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
        if (!accumulate)
            for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, sizeof(float) * (size_t)n);
        return;
    }
    const int64_t npan = (n + KVC_NR - 1) / KVC_NR;
    const int par = (double)m * n * k >= 65536.0 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t jp = 0; jp < npan; jp++) {
        const int nr = (int)imin64(KVC_NR, n - jp * KVC_NR);
        for (int64_t p0 = 0; p0 < k; p0 += KC_NN) {
            const int64_t kc = imin64(KC_NN, k - p0);
            for (int64_t i = 0; i < m; i += KVC_MR) {
                const int mr = (int)imin64(KVC_MR, m - i);
                kvc_cpu_ukr(mr, nr, kc, a + i * lda + p0, lda, b + p0 * ldb + jp * KVC_NR, ldb, c + i * ldc + jp * KVC_NR,
                            ldc, accumulate || p0 > 0);
            }
        }
    }
}

void kvc_host_probs_rows(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                         const int64_t *visible, float *probs) {
    kvc_host_probs_rows_capped(q_rows, m, k, len, d, scale, 0.0f, visible, probs);
}

void kvc_host_probs_rows_capped(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                                float cap, const int64_t *visible, float *probs) {
    kvc_cpu_matmul(q_rows, k, probs, m, len, d);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        float *row = probs + i * len;
        const int64_t vis = visible[i] < len ? visible[i] : len;
        float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
        for (int64_t r = 0; r < vis; r++) {
            row[r] *= scale;
            mx = row[r] > mx ? row[r] : mx;
        }
        if (cap > 0) { /* tanh is monotone: the capped max is the max capped */
            for (int64_t r = 0; r < vis; r++) row[r] = kvc_softcap(row[r], cap);
            mx = kvc_softcap(mx, cap);
        }
#pragma omp simd
        for (int64_t r = 0; r < vis; r++) row[r] -= mx;
        kvc_vexp(row, row, vis); /* the attention kernel's exp (within a few 1e-9 of expf); the scorers' hot loop */
        double z = 0;
#pragma omp simd reduction(+ : z)
        for (int64_t r = 0; r < vis; r++) z += row[r];
        const float inv = (float)(1.0 / z);
#pragma omp simd
        for (int64_t r = 0; r < vis; r++) row[r] *= inv;
        for (int64_t r = vis; r < len; r++) row[r] = 0.f;
    }
}

void kvc_host_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    kvc_cpu_rmsnorm(x, dim, w, y, dim, rows, dim, eps);
}

void kvc_host_head_rmsnorm(float *x, int64_t n, int32_t heads, int32_t d, const float *w, float eps) {
    kvc_cpu_head_rmsnorm(x, (int64_t)heads * d, n, heads, d, w, eps);
}

void kvc_host_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                   int32_t pairing, float mscale) {
    kvc_cpu_rope(x, (int64_t)heads * d, pos, n, heads, d, inv_freq, pairing, mscale);
}

void kvc_host_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    kvc_cpu_swiglu(gate, up, out, rows, dim);
}

void kvc_host_add_bias(float *y, const float *b, int64_t rows, int64_t dim) { kvc_cpu_add_bias(y, dim, b, rows, dim); }

/* ---- top-k ---- */

typedef struct {
    float s;
    int64_t r;
} cand;

/* higher score first, then lower row */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return (x->r > y->r) - (x->r < y->r);
}

static int row_cmp(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

kvc_status kvc_host_topk_rows(const float *scores, int64_t n, int64_t k, int64_t *out) {
    if (k >= n) {
        for (int64_t r = 0; r < n; r++) out[r] = r;
        return KVC_OK;
    }
    if (k <= 0) return KVC_OK;
    cand *c = malloc(sizeof(cand) * (size_t)n);
    if (!c) return kvc_fail(KVC_ERR_NOMEM, "out of memory: top-%lld of %lld scores", (long long)k, (long long)n);
    for (int64_t r = 0; r < n; r++) c[r] = (cand){isnan(scores[r]) ? -INFINITY : scores[r], r};
    qsort(c, (size_t)n, sizeof(cand), cand_cmp);
    for (int64_t i = 0; i < k; i++) out[i] = c[i].r;
    qsort(out, (size_t)k, sizeof(int64_t), row_cmp);
    free(c);
    return KVC_OK;
}
