/* GEMM: C[m,n] = A[m,k] B[n,k]^T (B a weight stored [out, in]), bf16 inputs, fp32 accumulation,
 * fp32 or bf16 output, optional accumulate into C (beta = 1).
 *
 * cuBLAS is loaded at run time with dlopen (KVC_CUBLAS=path, else libcublas.so.13 / .12 / .so, which
 * includes the copy a CUDA build of PyTorch ships in nvidia/cu13 or nvidia/cublas): the build needs
 * no cuBLAS headers and the library works without it. The few entry points are declared here from
 * the documented cuBLAS API (stable ABI, cublas_api.h). Row-major C = A B^T is the column-major
 * C^T = B A^T: cublasGemmEx(OP_T, OP_N, n, m, k, B, ldb, A, lda, C, ldc).
 * Without cuBLAS a built-in tensor-core (WMMA) kernel runs: 128 x 64 tiles, 8 warps, 32-deep k steps. */
#include <dlfcn.h>
#include <mma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

namespace kvc {

/* ---- cuBLAS, declared from its documented ABI ---- */
typedef void *cublasHandle_t;
typedef int cublasStatus_t;
enum { CUBLAS_OP_N_ = 0, CUBLAS_OP_T_ = 1 };
enum { CUDA_R_32F_ = 0, CUDA_R_16BF_ = 14 };
enum { CUBLAS_COMPUTE_32F_ = 68 };
enum { CUBLAS_GEMM_DEFAULT_ = -1 };
typedef cublasStatus_t (*create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*set_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*set_ws_fn)(cublasHandle_t, void *, size_t);
typedef cublasStatus_t (*gemm_ex_fn)(cublasHandle_t, int, int, int, int, int, const void *, const void *, int, int,
                                     const void *, int, int, const void *, void *, int, int, int, int);
typedef const char *(*status_string_fn)(cublasStatus_t);

static struct {
    void *lib;
    cublasHandle_t handle;
    gemm_ex_fn gemm_ex;
    status_string_fn status_string;
    void *workspace;
    size_t ws_bytes;
    char name[600];
    int force_builtin;
} cb;

static const char *cublas_error(cublasStatus_t s) {
    if (cb.status_string) return cb.status_string(s);
    switch (s) {
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
    }
}

kvc_status gemm_init(void) {
    snprintf(cb.name, sizeof cb.name,
             "built-in WMMA GEMM: cuBLAS NOT FOUND (several times slower; install nvidia-cublas-cu13 or set KVC_CUBLAS)");
    if (getenv("KVC_CUBLAS") && strcmp(getenv("KVC_CUBLAS"), "0") == 0) {
        snprintf(cb.name, sizeof cb.name, "built-in WMMA GEMM (cuBLAS disabled by KVC_CUBLAS=0)");
        return KVC_OK;
    }
    const char *cands[] = {getenv("KVC_CUBLAS"), "libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (const char *c : cands) {
        if (!c || !*c) continue;
        void *h = dlopen(c, RTLD_NOW | RTLD_LOCAL);
        if (!h) continue;
        create_fn create = (create_fn)dlsym(h, "cublasCreate_v2");
        set_stream_fn set_stream = (set_stream_fn)dlsym(h, "cublasSetStream_v2");
        set_ws_fn set_ws = (set_ws_fn)dlsym(h, "cublasSetWorkspace_v2");
        gemm_ex_fn gemm_ex = (gemm_ex_fn)dlsym(h, "cublasGemmEx");
        if (!create || !set_stream || !gemm_ex) {
            dlclose(h);
            continue;
        }
        cublasHandle_t handle = nullptr;
        if (create(&handle) != 0 || set_stream(handle, g.stream) != 0) {
            dlclose(h);
            continue;
        }
        /* a fixed workspace: no allocation inside cuBLAS calls (CUDA graph capture needs that) */
        cb.ws_bytes = 32u << 20;
        if (set_ws && dalloc(&cb.workspace, cb.ws_bytes, MEM_ACT, "cuBLAS workspace") == KVC_OK)
            set_ws(handle, cb.workspace, cb.ws_bytes);
        cb.lib = h;
        cb.handle = handle;
        cb.gemm_ex = gemm_ex;
        cb.status_string = (status_string_fn)dlsym(h, "cublasGetStatusString");
        Dl_info info;
        const char *path = dladdr((void *)gemm_ex, &info) && info.dli_fname ? info.dli_fname : c;
        snprintf(cb.name, sizeof cb.name, "cublas (%s)", path);
        return KVC_OK;
    }
    return KVC_OK;
}

const char *gemm_name(void) { return cb.force_builtin ? "built-in WMMA GEMM (forced by the builtin_gemm setting)" : cb.name; }
void gemm_force_builtin(int on) { cb.force_builtin = on; }
int gemm_builtin_forced(void) { return cb.force_builtin; }

/* ---- the built-in WMMA kernel ---- */
using namespace nvcuda;
#define GM 128
#define GN 64
#define GK 32
#define GPAD 8

__global__ void __launch_bounds__(256) gemm_wmma_kernel(const bf16 *__restrict__ A, int64_t lda,
                                                        const bf16 *__restrict__ B, int64_t ldb, void *C, int64_t ldc,
                                                        int c_f32, int64_t m, int64_t n, int64_t k, float beta) {
    __shared__ __align__(32) bf16 As[GM][GK + GPAD];
    __shared__ __align__(32) bf16 Bs[GN][GK + GPAD];
    __shared__ __align__(32) float Cs[8][16][16 + 4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t m0 = (int64_t)blockIdx.y * GM, n0 = (int64_t)blockIdx.x * GN;
    const int wm = warp / 2, wn = warp % 2; /* warp tile: rows wm*32 .. +32, cols wn*32 .. +32 */
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.f);
    for (int64_t k0 = 0; k0 < k; k0 += GK) {
        /* A tile 128 x 32: 4096 values, 16 per thread; B tile 64 x 32: 8 per thread */
        for (int t = threadIdx.x; t < GM * GK; t += 256) {
            const int r = t / GK, c = t % GK;
            const int64_t gr = m0 + r, gc = k0 + c;
            As[r][c] = (gr < m && gc < k) ? A[gr * lda + gc] : __float2bfloat16(0.f);
        }
        for (int t = threadIdx.x; t < GN * GK; t += 256) {
            const int r = t / GK, c = t % GK;
            const int64_t gr = n0 + r, gc = k0 + c;
            Bs[r][c] = (gr < n && gc < k) ? B[gr * ldb + gc] : __float2bfloat16(0.f);
        }
        __syncthreads();
        for (int kk = 0; kk < GK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], &As[wm * 32 + i * 16][kk], GK + GPAD);
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], &Bs[wn * 32 + j * 16][kk], GK + GPAD);
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(&Cs[warp][0][0], acc[i][j], 16 + 4, wmma::mem_row_major);
            __syncwarp();
            for (int t = lane; t < 256; t += 32) {
                const int r = t / 16, c = t % 16;
                const int64_t gr = m0 + wm * 32 + i * 16 + r, gc = n0 + wn * 32 + j * 16 + c;
                if (gr < m && gc < n) {
                    float v = Cs[warp][r][c];
                    if (c_f32) {
                        float *cp = (float *)C + gr * ldc + gc;
                        *cp = beta != 0.f ? *cp + v : v;
                    } else {
                        bf16 *cp = (bf16 *)C + gr * ldc + gc;
                        *cp = __float2bfloat16(beta != 0.f ? __bfloat162float(*cp) + v : v);
                    }
                }
            }
            __syncwarp();
        }
}

kvc_status gemm(const bf16 *A, int64_t lda, const bf16 *B, int64_t ldb, void *C, int64_t ldc, int c_f32, int64_t m,
                int64_t n, int64_t k, float beta) {
    if (m <= 0 || n <= 0 || k <= 0) return KVC_OK;
    if (cb.handle && !cb.force_builtin && m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX) {
        const float alpha = 1.f;
        cublasStatus_t s = cb.gemm_ex(cb.handle, CUBLAS_OP_T_, CUBLAS_OP_N_, (int)n, (int)m, (int)k, &alpha, B,
                                      CUDA_R_16BF_, (int)ldb, A, CUDA_R_16BF_, (int)lda, &beta, C,
                                      c_f32 ? CUDA_R_32F_ : CUDA_R_16BF_, (int)ldc, CUBLAS_COMPUTE_32F_,
                                      CUBLAS_GEMM_DEFAULT_);
        if (s != 0)
            return fail(s == 3 ? KVC_ERR_NOMEM : KVC_ERR_DEVICE, "cublasGemmEx (m=%lld n=%lld k=%lld): %s",
                        (long long)m, (long long)n, (long long)k, cublas_error(s));
        return KVC_OK;
    }
    dim3 grid((unsigned)((n + GN - 1) / GN), (unsigned)((m + GM - 1) / GM));
    if (grid.y > 65535) return fail(KVC_ERR_ARG, "gemm: m = %lld rows is too many for the built-in kernel", (long long)m);
    gemm_wmma_kernel<<<grid, 256, 0, g.stream>>>(A, lda, B, ldb, C, ldc, c_f32, m, n, k, beta);
    LAUNCH_TRY("gemm (wmma)");
    return KVC_OK;
}

} // namespace kvc
