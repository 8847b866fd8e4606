/* GEMM for the CPU backend: C[m,n] = A[m,k] * B[n,k]^T (B is a weight matrix stored [out, in]).
 *
 * Two implementations behind one entry point:
 *  - an external CBLAS sgemm loaded at run time (OpenBLAS from the scipy-openblas32 wheel by default,
 *    see kvpress_c/__init__.py), called single-threaded on column slices that our own OpenMP threads
 *    share out, so only one thread pool ever spins (two pools on two cores thrash each other);
 *  - a built-in kernel: a 4x4 register tile of dot products over k (both operands are k-contiguous),
 *    vectorised by the compiler, OpenMP over output tiles. It is the fallback when no BLAS is loaded
 *    and the path for small m (decode steps are GEMVs bound by memory bandwidth, where it matches BLAS
 *    without BLAS's per-call overhead).
 * benchmarks/gemm.py measures both; the README records the figures behind the choice. */
#include <dlfcn.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "../../core/common.h"

typedef void (*cblas_sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                               int lda, const float *b, int ldb, float beta, float *c, int ldc);
typedef void (*set_threads_fn)(int);

static cblas_sgemm_fn g_sgemm;
static char g_blas_name[1024] = "builtin";
static int g_blas_min_m = 16; /* below this many rows the built-in kernel is used */

enum { CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112 };

kvc_status kvc_set_blas(const char *path, const char *symbol) {
    if (!path) {
        g_sgemm = NULL;
        snprintf(g_blas_name, sizeof g_blas_name, "builtin");
        return KVC_OK;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return kvc_fail(KVC_ERR_IO, "cannot load BLAS library '%s': %s", path, dlerror());
    const char *sym = symbol && *symbol ? symbol : "cblas_sgemm";
    cblas_sgemm_fn f = (cblas_sgemm_fn)dlsym(h, sym);
    if (!f) {
        dlclose(h);
        return kvc_fail(KVC_ERR_IO, "'%s' has no symbol '%s' (try scipy_cblas_sgemm or cblas_sgemm)", path, sym);
    }
    /* our threads split the work: make the library single-threaded */
    const char *names[] = {"scipy_openblas_set_num_threads", "openblas_set_num_threads", "scipy_goto_set_num_threads"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        set_threads_fn st = (set_threads_fn)dlsym(h, names[i]);
        if (st) {
            st(1);
            break;
        }
    }
    g_sgemm = f;
    snprintf(g_blas_name, sizeof g_blas_name, "%s", path);
    return KVC_OK;
}

const char *kvc_blas_name(void) { return g_blas_name; }

void kvc_set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : omp_get_num_procs()); }
int kvc_get_num_threads(void) { return omp_get_max_threads(); }

/* 4 x 4 block of dot products: c[i][j] = a_i . b_j over k */
static inline void dot4x4(const float *a, const float *b, int64_t k, int64_t lda, int64_t ldb, float out[4][4], int mi, int nj) {
    float acc[4][4] = {{0}};
    if (mi == 4 && nj == 4) {
        const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
        const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb, *b3 = b + 3 * ldb;
        float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
        float s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)
        for (int64_t t = 0; t < k; t++) {
            s00 += a0[t] * b0[t]; s01 += a0[t] * b1[t]; s02 += a0[t] * b2[t]; s03 += a0[t] * b3[t];
            s10 += a1[t] * b0[t]; s11 += a1[t] * b1[t]; s12 += a1[t] * b2[t]; s13 += a1[t] * b3[t];
            s20 += a2[t] * b0[t]; s21 += a2[t] * b1[t]; s22 += a2[t] * b2[t]; s23 += a2[t] * b3[t];
            s30 += a3[t] * b0[t]; s31 += a3[t] * b1[t]; s32 += a3[t] * b2[t]; s33 += a3[t] * b3[t];
        }
        float r[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
        memcpy(out, r, sizeof r);
        return;
    }
    for (int i = 0; i < mi; i++)
        for (int j = 0; j < nj; j++) {
            float s = 0;
            const float *ai = a + i * lda, *bj = b + j * ldb;
#pragma omp simd reduction(+ : s)
            for (int64_t t = 0; t < k; t++) s += ai[t] * bj[t];
            acc[i][j] = s;
        }
    memcpy(out, acc, sizeof acc);
}

/* GEMV-friendly built-in kernel: parallel over n (weight rows), 4x4 tiles. */
static void builtin_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = (n + 3) / 4, mb = (m + 3) / 4;
#pragma omp parallel for schedule(static) collapse(2) if (m * n * k > 32768)
    for (int64_t jb = 0; jb < nb; jb++) {
        for (int64_t ib = 0; ib < mb; ib++) {
            const int64_t i0 = ib * 4, j0 = jb * 4;
            const int mi = (int)(m - i0 < 4 ? m - i0 : 4), nj = (int)(n - j0 < 4 ? n - j0 : 4);
            float out[4][4];
            dot4x4(a + i0 * k, b + j0 * k, k, k, k, out, mi, nj);
            for (int i = 0; i < mi; i++)
                for (int j = 0; j < nj; j++) c[(i0 + i) * n + j0 + j] = out[i][j];
        }
    }
}

/* External BLAS on column slices, one slice per thread. */
static void blas_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    const int nt = omp_get_max_threads();
    const int64_t slice = ((n + nt - 1) / nt + 15) / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int t = 0; t < nt; t++) {
        const int64_t j0 = (int64_t)t * slice;
        if (j0 >= n) continue;
        const int64_t nj = n - j0 < slice ? n - j0 : slice;
        g_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nj, (int)k, 1.0f, a, (int)k, b + j0 * k, (int)k,
                0.0f, c + j0, (int)n);
    }
}

void kvc_cpu_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    if (g_sgemm && m >= g_blas_min_m && m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX) {
        if (omp_in_parallel()) /* called from a parallel region: one thread, no nested teams */
            g_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1.0f, a, (int)k, b, (int)k, 0.0f, c, (int)n);
        else
            blas_matmul(a, b, c, m, n, k);
        return;
    }
    builtin_matmul(a, b, c, m, n, k);
}
