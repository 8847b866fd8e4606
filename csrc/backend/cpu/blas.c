/* Runtime settings of the CPU backend (threads, external BLAS) and kvc_cpu_matmul, which picks the
 * built-in GEMM (gemm.c) or an external CBLAS sgemm for each call (kvc_cpu_gemm).
 *
 * The external library is loaded with dlopen at run time (kvc_set_blas, or KVC_BLAS=path at first
 * use), so the core links against no BLAS. It is made single-threaded and our own OpenMP threads
 * each call it on a slice of the columns, so that only one thread pool is ever active: OpenMP's
 * threads keep spinning for a while after each parallel region, and a second pool (OpenBLAS's)
 * would compete with them for the cores.
 *
 * Which one runs where: BLAS_MIN_M below, chosen from the measurements at the top of gemm.c.
 * kvc_blas_name() names the loaded library even where the dispatch leaves it unused. */
#include <dlfcn.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/common.h"
#include "cpu.h"

typedef void (*cblas_sgemm_fn)(int order, int transa, int transb, int m, int n, int k, float alpha,
                               const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);
typedef void (*set_threads_fn)(int);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

/* Rows of A from which a loaded external BLAS is used (below: the built-in kernel), from
 * benchmarks/gemm.py on this machine (figures at the top of gemm.c):
 *  - AVX-512: the built-in kernel is as fast as OpenBLAS or faster at every size, so a loaded BLAS
 *    is not used unless asked for;
 *  - AVX2 (the built-in 6 x 16 kernel against OpenBLAS's Haswell kernels, OPENBLAS_CORETYPE=Haswell,
 *    one thread): the built-in kernel wins or ties up to m = 64 (GEMV 2-4x faster), OpenBLAS is
 *    5-10 % faster from m = 128;
 *  - plain C (not measured): any tuned BLAS beats it once there is more than one row.
 * KVC_BLAS_MIN_M=<rows> overrides it (read when a library is loaded; benchmarks/gemm.py sets 1 to
 * time the library alone). */
#if defined(__AVX512F__)
#define BLAS_MIN_M INT64_MAX
#elif defined(KVC_SIMD)
#define BLAS_MIN_M 128
#else
#define BLAS_MIN_M 2
#endif
static atomic_llong g_blas_min_m = BLAS_MIN_M;

static void read_min_m(void) {
    const char *s = getenv("KVC_BLAS_MIN_M");
    char *end = NULL;
    const long long v = s && *s ? strtoll(s, &end, 10) : -1;
    atomic_store(&g_blas_min_m, v >= 0 && end && *end == '\0' ? v : BLAS_MIN_M);
}

static _Atomic(cblas_sgemm_fn) g_sgemm;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* guards g_name and g_explicit */
static char g_name[1024] = "builtin";
static int g_explicit;                                    /* kvc_set_blas was called */
static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;
static atomic_int g_threads;                              /* 0: OpenMP's default */

int kvc_cpu_threads(void) {
    const int t = atomic_load_explicit(&g_threads, memory_order_relaxed);
    return t > 0 ? t : omp_get_max_threads();
}

void kvc_set_num_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    atomic_store(&g_threads, n);
    omp_set_num_threads(n); /* for the parallel regions elsewhere in the core (calling thread) */
}

int kvc_get_num_threads(void) { return kvc_cpu_threads(); }

/* Open `path` and find `symbol` (or, when symbol is NULL/empty, cblas_sgemm then scipy_cblas_sgemm).
 * The handle is never closed: another thread may still be inside the old library. */
static kvc_status load_blas(const char *path, const char *symbol, cblas_sgemm_fn *out) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return kvc_fail(KVC_ERR_IO, "cannot load the BLAS library '%s': %s", path, dlerror());
    cblas_sgemm_fn f = NULL;
    if (symbol && *symbol) {
        f = (cblas_sgemm_fn)dlsym(h, symbol);
    } else {
        f = (cblas_sgemm_fn)dlsym(h, "cblas_sgemm");
        if (!f) f = (cblas_sgemm_fn)dlsym(h, "scipy_cblas_sgemm");
    }
    if (!f) {
        dlclose(h);
        return kvc_fail(KVC_ERR_IO, "the BLAS library '%s' has no symbol '%s' (try cblas_sgemm or scipy_cblas_sgemm)",
                        path, symbol && *symbol ? symbol : "cblas_sgemm");
    }
    /* our threads share the work out: the library must not start its own pool */
    static const char *setters[] = {"openblas_set_num_threads", "scipy_openblas_set_num_threads",
                                    "scipy_openblas_set_num_threads64_", "mkl_set_num_threads",
                                    "bli_thread_set_num_threads"};
    for (size_t i = 0; i < sizeof setters / sizeof *setters; i++) {
        set_threads_fn st = (set_threads_fn)dlsym(h, setters[i]);
        if (st) {
            st(1);
            break;
        }
    }
    *out = f;
    read_min_m();
    return KVC_OK;
}

static void init_from_env(void) {
    const char *path = getenv("KVC_BLAS");
    if (!path || !*path) return;
    pthread_mutex_lock(&g_lock);
    if (!g_explicit) { /* an explicit kvc_set_blas wins over the environment */
        cblas_sgemm_fn f = NULL;
        if (load_blas(path, getenv("KVC_BLAS_SYMBOL"), &f) == KVC_OK) {
            snprintf(g_name, sizeof g_name, "%s", path);
            atomic_store(&g_sgemm, f);
        } else {
            fprintf(stderr, "kvpress_c: KVC_BLAS ignored: %s\n", kvc_last_error());
        }
    }
    pthread_mutex_unlock(&g_lock);
}

kvc_status kvc_set_blas(const char *path, const char *symbol) {
    pthread_once(&g_env_once, init_from_env);
    cblas_sgemm_fn f = NULL;
    if (path) KVC_TRY(load_blas(path, symbol, &f));
    pthread_mutex_lock(&g_lock);
    g_explicit = 1;
    snprintf(g_name, sizeof g_name, "%s", path ? path : "builtin");
    atomic_store(&g_sgemm, f);
    pthread_mutex_unlock(&g_lock);
    return KVC_OK;
}

const char *kvc_blas_name(void) {
    pthread_once(&g_env_once, init_from_env);
    return g_name;
}

int kvc_cpu_gemm_blas(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      int accumulate) {
    pthread_once(&g_env_once, init_from_env);
    const cblas_sgemm_fn f = atomic_load(&g_sgemm);
    if (!f || m <= 0 || n <= 0 || k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX ||
        ldc > INT32_MAX)
        return 0;
    const int nt = omp_in_parallel() ? 1 : kvc_cpu_threads();
    /* column slices, a multiple of 16 wide, one per thread */
    const int64_t slice = ((n + nt - 1) / nt + 15) / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        const int64_t j0 = (int64_t)t * slice;
        if (j0 < n) {
            const int64_t nj = n - j0 < slice ? n - j0 : slice;
            f(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, (int)m, (int)nj, (int)k, 1.0f, a, (int)lda, b + j0 * k,
              (int)k, accumulate ? 1.0f : 0.0f, c + j0, (int)ldc);
        }
    }
    return 1;
}

void kvc_cpu_gemm(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                  int accumulate) {
    if (m >= atomic_load_explicit(&g_blas_min_m, memory_order_relaxed) &&
        kvc_cpu_gemm_blas(a, lda, b, c, ldc, m, n, k, accumulate))
        return;
    kvc_cpu_gemm_builtin(a, lda, b, c, ldc, m, n, k, accumulate);
}

void kvc_cpu_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    kvc_cpu_gemm(a, k, b, c, n, m, n, k, 0);
}
