/* cuDNN's fused attention behind the kernel table (attention_kernel 2): the prefill of a layer whose heads lie at
 * one stride (every head the same capacity: a full cache, a uniform press) and that has no sliding window and no
 * ThinK-pruned keys runs in cuDNN's SDPA, each KV head a batch entry with its length from the store's device length
 * table, bottom-right causal (csrc/backend/cudnn/sdpa_cudnn.cpp). Everything else, and any shape cuDNN has no plan
 * for, runs on the backend's own kernels. cuDNN is opened at run time like cuBLAS: libcudnn.so.9 from KVC_CUDNN (a
 * path) or the loader's search (a CUDA build of PyTorch ships it in nvidia/cudnn/lib), then libkvpress_c_cudnn.so
 * from beside this library; a build without the cuDNN headers has no such library, and asking for the kernel then
 * says why. Compile-only in this project's CI (no GPU). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../cudnn/cudnn_shim.h"
#include "common.cuh"

namespace kvc {

static struct {
    int tried, ok, on;
    char why[1024];
    kvc_cudnn_shim_sdpa_fn sdpa;
} cd;
static Buf g_ws, g_seq_q; /* cuDNN's workspace; every entry's query count */

/* the shim sits beside this library */
static void shim_path(char *out, size_t cap) {
    Dl_info info;
    if (dladdr((void *)shim_path, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            snprintf(out, cap, "%.*s/libkvpress_c_cudnn.so", (int)(slash - info.dli_fname), info.dli_fname);
            return;
        }
    }
    snprintf(out, cap, "libkvpress_c_cudnn.so");
}

static void load(void) {
    cd.tried = 1;
    const char *env = getenv("KVC_CUDNN");
    if (env && !strcmp(env, "0")) {
        snprintf(cd.why, sizeof cd.why, "cuDNN disabled by KVC_CUDNN=0");
        return;
    }
    /* libcudnn.so.9 first, global: the shim's dependency on it is then met by its soname */
    const char *cands[] = {env, "libcudnn.so.9"};
    void *lib = nullptr;
    for (const char *c : cands)
        if (c && *c && (lib = dlopen(c, RTLD_NOW | RTLD_GLOBAL))) break;
    if (!lib) {
        snprintf(cd.why, sizeof cd.why, "libcudnn.so.9 not found (install nvidia-cudnn-cu13 or set KVC_CUDNN to its path): %s",
                 dlerror());
        return;
    }
    /* libcudnn.so.9 opens its parts (libcudnn_graph.so.9, ...) from its own folder and aborts the process when
     * one is missing: a lone loader stub (the one the build links against) must stop here, not in cudnnCreate */
    Dl_info info;
    void *sym = dlsym(lib, "cudnnGetVersion");
    char path[4096];
    if (!sym || !dladdr(sym, &info) || !info.dli_fname || !strrchr(info.dli_fname, '/')) {
        snprintf(cd.why, sizeof cd.why, "libcudnn.so.9 was found but its folder is unknown");
        return;
    }
    snprintf(path, sizeof path, "%.*s/libcudnn_graph.so.9", (int)(strrchr(info.dli_fname, '/') - info.dli_fname),
             info.dli_fname);
    if (access(path, R_OK) != 0) {
        snprintf(cd.why, sizeof cd.why, "%s has no libcudnn_graph.so.9 beside it (an incomplete cuDNN install)",
                 info.dli_fname);
        return;
    }
    shim_path(path, sizeof path);
    void *shim = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!shim) {
        snprintf(cd.why, sizeof cd.why, "%s not loaded (built only where the cuDNN headers were found): %s", path, dlerror());
        return;
    }
    kvc_cudnn_shim_version_fn version = (kvc_cudnn_shim_version_fn)dlsym(shim, KVC_CUDNN_SHIM_VERSION_SYMBOL);
    kvc_cudnn_shim_open_fn open = (kvc_cudnn_shim_open_fn)dlsym(shim, KVC_CUDNN_SHIM_OPEN_SYMBOL);
    cd.sdpa = (kvc_cudnn_shim_sdpa_fn)dlsym(shim, KVC_CUDNN_SHIM_SDPA_SYMBOL);
    if (!version || !open || !cd.sdpa || version() != KVC_CUDNN_SHIM_VERSION) {
        snprintf(cd.why, sizeof cd.why, "%s is of another version (want %d): rebuild", path, KVC_CUDNN_SHIM_VERSION);
        return;
    }
    if (open((void *)g.stream, cd.why, sizeof cd.why) != KVC_CUDNN_OK) return;
    cd.ok = 1;
}

kvc_status attention_use_cudnn(int on) {
    if (!on) {
        cd.on = 0;
        return KVC_OK;
    }
    if (!cd.tried) load();
    if (!cd.ok) return fail(KVC_ERR_UNSUPPORTED, "cuDNN attention is not available: %s", cd.why);
    cd.on = 1;
    return KVC_OK;
}

int attention_cudnn_enabled(void) { return cd.on; }

__global__ void fill_i32_kernel(int32_t *p, int32_t v, int32_t count) {
    for (int32_t i = threadIdx.x; i < count; i += blockDim.x) p[i] = v;
}

kvc_status attention_cudnn(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const bf16 *k0,
                           const bf16 *v0, int64_t head_stride, const int32_t *seq_kv, int64_t max_kv, float scale, bf16 *out,
                           int64_t ldo) {
    if (!cd.on || n >= 2147483647 || H % Hkv) return KVC_ERR_UNSUPPORTED;
    KVC_TRY(scratch(g_seq_q, sizeof(int32_t) * (size_t)Hkv, "cuDNN query counts"));
    fill_i32_kernel<<<1, 64, 0, g.stream>>>(g_seq_q.as<int32_t>(), (int32_t)n, Hkv);
    LAUNCH_TRY("cuDNN query counts");
    kvc_cudnn_sdpa_args a;
    memset(&a, 0, sizeof a);
    a.q = q;
    a.ldq = ldq;
    a.k = k0;
    a.v = v0;
    a.head_stride = head_stride;
    a.seq_q = g_seq_q.as<int32_t>();
    a.seq_kv = seq_kv;
    a.o = out;
    a.ldo = ldo;
    a.n = n;
    a.max_kv = max_kv;
    a.Hkv = Hkv;
    a.g = H / Hkv;
    a.d = d;
    a.scale = scale;
    a.stream = (void *)g.stream;
    char why[1024] = "";
    for (int attempt = 0; attempt < 2; attempt++) {
        size_t need = 0;
        const int r = cd.sdpa(&a, g_ws.p, g_ws.bytes, &need, why, sizeof why);
        if (r == KVC_CUDNN_OK) return KVC_OK;
        if (r == KVC_CUDNN_UNSUPPORTED) return KVC_ERR_UNSUPPORTED; /* the own kernels run it */
        if (r == KVC_CUDNN_ERROR) return fail(KVC_ERR_DEVICE, "%s", why);
        KVC_TRY(scratch(g_ws, need, "cuDNN workspace"));
    }
    return fail(KVC_ERR_INTERNAL, "cuDNN attention: the workspace it asked for was not enough");
}

} // namespace kvc
