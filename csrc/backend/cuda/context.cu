/* The device context: initialisation (device, stream, GEMM handle), error reporting through the
 * core, and tracked device allocation (current and peak bytes per category, for the memory report). */
#include <dlfcn.h>
#include <atomic>
#include <mutex>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"

namespace kvc {

Context g;
static const kvc_host_services *g_host;
static char g_local_error[1024]; /* used only before init hands us the core's error service */

kvc_status fail(kvc_status st, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (g_host && g_host->fail) return g_host->fail(st, "%s", buf);
    snprintf(g_local_error, sizeof g_local_error, "%s", buf);
    return st;
}

/* Errors after which the context is dead (every later CUDA call returns them, nothing can be rolled back):
 * the first one is remembered, and every later entry of the backend fails fast with it (context_alive). */
static std::atomic<int> g_lost{0};
static char g_lost_why[512];

static int context_killer(cudaError_t e) {
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable: return 1;
    default: return 0;
    }
}

kvc_status context_alive(void) {
    if (g_lost.load(std::memory_order_acquire)) return fail(KVC_ERR_DEVICE, "%s", g_lost_why);
    return KVC_OK;
}

kvc_status cuda_fail(cudaError_t e, const char *what) {
    if (context_killer(e) && !g_lost.load(std::memory_order_acquire)) {
        snprintf(g_lost_why, sizeof g_lost_why, "the CUDA context is lost after %s (%s) in %s: restart the process",
                 cudaGetErrorString(e), cudaGetErrorName(e), what);
        g_lost.store(1, std::memory_order_release);
    }
    if (g_lost.load(std::memory_order_acquire)) return fail(KVC_ERR_DEVICE, "%s", g_lost_why);
    cudaGetLastError(); /* clear a non-sticky error so the context stays usable */
    if (e == cudaErrorMemoryAllocation) {
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return fail(KVC_ERR_NOMEM, "CUDA out of memory: %s (%.2f GiB free of %.2f GiB)", what, fr / 1073741824.0,
                    tot / 1073741824.0);
    }
    return fail(KVC_ERR_DEVICE, "CUDA error in %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

kvc_status check_launch(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_fail(e, what);
    return KVC_OK;
}

/* ---- init ---------------------------------------------------------------------------------------- */

static std::once_flag g_once;
static kvc_status g_init_status = KVC_ERR_DEVICE;
static char g_init_reason[512] = "not initialised";

__global__ void probe_kernel() {}

static void do_init(void) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
        if (!drv)
            snprintf(g_init_reason, sizeof g_init_reason,
                     "no NVIDIA driver on this machine (libcuda.so.1 cannot be opened): %s", cudaGetErrorString(e));
        else if (e == cudaErrorInsufficientDriver)
            snprintf(g_init_reason, sizeof g_init_reason,
                     "the NVIDIA driver is older than the CUDA %d.%d runtime this backend was built with",
                     CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        else
            snprintf(g_init_reason, sizeof g_init_reason, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        if (drv) dlclose(drv);
        cudaGetLastError();
        return;
    }
    if (count == 0) {
        snprintf(g_init_reason, sizeof g_init_reason, "no CUDA device is visible");
        return;
    }
    g.device = 0;
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, g.device)) != cudaSuccess || (e = cudaSetDevice(g.device)) != cudaSuccess) {
        snprintf(g_init_reason, sizeof g_init_reason, "device 0: %s", cudaGetErrorString(e));
        return;
    }
    if (prop.major < 8) {
        snprintf(g_init_reason, sizeof g_init_reason,
                 "device 0 (%s) has compute capability %d.%d; bf16 tensor cores need 8.0 or newer", prop.name,
                 prop.major, prop.minor);
        return;
    }
    snprintf(g.name, sizeof g.name, "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
             prop.totalGlobalMem / 1073741824.0);
    g.sm_count = prop.multiProcessorCount;
    g.total_mem = prop.totalGlobalMem;
    if ((e = cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking)) != cudaSuccess) {
        snprintf(g_init_reason, sizeof g_init_reason, "cannot create a stream: %s", cudaGetErrorString(e));
        return;
    }
    /* a kernel image for this device? (the library is built for one architecture: KVC_CUDA_ARCH) */
    probe_kernel<<<1, 1, 0, g.stream>>>();
    if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaStreamSynchronize(g.stream)) != cudaSuccess) {
        snprintf(g_init_reason, sizeof g_init_reason,
                 "cannot run kernels on %s: %s (rebuild with KVC_CUDA_ARCH=%d%d)", prop.name, cudaGetErrorString(e),
                 prop.major, prop.minor);
        cudaGetLastError();
        return;
    }
    kvc_status st = gemm_init();
    if (st != KVC_OK) {
        snprintf(g_init_reason, sizeof g_init_reason, "GEMM initialisation failed");
        return;
    }
    g.ready = 1;
    g_init_status = KVC_OK;
}

kvc_status ensure_init(void) {
    std::call_once(g_once, do_init);
    if (g_init_status != KVC_OK) return fail(KVC_ERR_DEVICE, "%s", g_init_reason);
    cudaSetDevice(g.device); /* the calling thread may be new */
    return KVC_OK;
}

kvc_status init_with_host(const kvc_host_services *host) {
    g_host = host;
    return ensure_init();
}

/* ---- tracked allocation ------------------------------------------------------------------------- */

static std::mutex g_mem_lock;
static int64_t g_cur, g_peak, g_cat[3], g_cat_peak[3];

kvc_status dalloc(void **p, size_t bytes, int cat, const char *what) {
    *p = nullptr;
    if (bytes == 0) bytes = 256;
    bytes = (bytes + 255) & ~(size_t)255;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        *p = nullptr;
        char msg[256];
        snprintf(msg, sizeof msg, "%s needs %.3f GiB", what, bytes / 1073741824.0);
        return cuda_fail(e, msg);
    }
    std::lock_guard<std::mutex> lk(g_mem_lock);
    g_cur += (int64_t)bytes;
    if (g_cur > g_peak) g_peak = g_cur;
    g_cat[cat] += (int64_t)bytes;
    if (g_cat[cat] > g_cat_peak[cat]) g_cat_peak[cat] = g_cat[cat];
    return KVC_OK;
}

void dfree(void *p, size_t bytes, int cat) {
    if (!p) return;
    if (bytes == 0) bytes = 256;
    bytes = (bytes + 255) & ~(size_t)255;
    /* a failed free still holds the memory: keep counting it (and clear the sticky-free error) */
    if (cudaFree(p) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    std::lock_guard<std::mutex> lk(g_mem_lock);
    g_cur -= (int64_t)bytes;
    g_cat[cat] -= (int64_t)bytes;
}

/* ---- host-device traffic (calls are serialised by the core's device lock) ---- */

static int64_t g_traffic[KVC_XFER_N];

void traffic_add(int64_t downs, int64_t ups, int64_t syncs, int64_t down_bytes, int64_t up_bytes) {
    g_traffic[KVC_XFER_DOWNLOADS] += downs;
    g_traffic[KVC_XFER_UPLOADS] += ups;
    g_traffic[KVC_XFER_SYNCS] += syncs;
    g_traffic[KVC_XFER_DOWN_BYTES] += down_bytes;
    g_traffic[KVC_XFER_UP_BYTES] += up_bytes;
}

void traffic_stats(int64_t *out, int reset) {
    memcpy(out, g_traffic, sizeof g_traffic);
    if (reset) memset(g_traffic, 0, sizeof g_traffic);
}

cudaError_t h2d(void *dst, const void *src, size_t bytes) {
    traffic_add(0, 1, 0, 0, (int64_t)bytes);
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream);
}

cudaError_t d2h(void *dst, const void *src, size_t bytes) {
    traffic_add(1, 0, 0, (int64_t)bytes, 0);
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream);
}

cudaError_t stream_wait(void) {
    traffic_add(0, 0, 1, 0, 0);
    return cudaStreamSynchronize(g.stream);
}

kvc_status Pinned::need(size_t b, const char *what) {
    if (b <= bytes) return KVC_OK;
    if (p) {
        cudaStreamSynchronize(g.stream); /* a copy in flight may still read it */
        cudaFreeHost(p);
    }
    p = nullptr;
    bytes = 0;
    const size_t nb = b + b / 4;
    const cudaError_t e = cudaMallocHost(&p, nb);
    if (e != cudaSuccess) {
        p = nullptr;
        return cuda_fail(e, what);
    }
    bytes = nb;
    return KVC_OK;
}

void memory_stats(int64_t *out) {
    std::lock_guard<std::mutex> lk(g_mem_lock);
    out[KVC_STAT_CURRENT] = g_cur;
    out[KVC_STAT_PEAK] = g_peak;
    out[KVC_STAT_WEIGHTS] = g_cat[MEM_WEIGHTS];
    out[KVC_STAT_CACHE] = g_cat[MEM_CACHE];
    out[KVC_STAT_CACHE_PEAK] = g_cat_peak[MEM_CACHE];
    out[KVC_STAT_ACT] = g_cat[MEM_ACT];
    out[KVC_STAT_ACT_PEAK] = g_cat_peak[MEM_ACT];
    out[KVC_STAT_DEVICE_TOTAL] = (int64_t)g.total_mem;
}

void reset_peak(void) {
    std::lock_guard<std::mutex> lk(g_mem_lock);
    g_peak = g_cur;
    for (int i = 0; i < 3; i++) g_cat_peak[i] = g_cat[i];
}

} // namespace kvc
