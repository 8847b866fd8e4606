/* Run-time loader of the CUDA backend. libkvpress_c_cuda.so is looked for next to this library
 * (dladdr), or at $KVC_CUDA_LIB; it is opened once, on the first call that needs it, so a machine
 * without CUDA never touches it. Every failure (library missing, no driver, no device, wrong
 * architecture) becomes a status with the reason; nothing aborts. Also the public kvc_cuda_* entry
 * points and the device placement of models. */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../model/model.h"
#include "../press/press.h"
#include "cuda_loader.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const kvc_cuda_api *g_api;
static char g_reason[8192] = "not loaded";

/* the CUDA library reports its errors through the core's kvc_last_error */
static kvc_status host_fail(kvc_status st, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return kvc_fail(st, "%s", buf);
}

static const kvc_cuda_host g_host = {host_fail};

static void library_path(char *out, size_t cap) {
    const char *env = getenv("KVC_CUDA_LIB");
    if (env && *env) {
        snprintf(out, cap, "%s", env);
        return;
    }
    Dl_info info;
    if (dladdr((void *)kvc_cuda_available, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            snprintf(out, cap, "%.*s/libkvpress_c_cuda.so", (int)(slash - info.dli_fname), info.dli_fname);
            return;
        }
    }
    snprintf(out, cap, "libkvpress_c_cuda.so");
}

static void load_once(void) {
    const char *off = getenv("KVC_CUDA");
    if (off && strcmp(off, "0") == 0) {
        snprintf(g_reason, sizeof g_reason, "disabled by KVC_CUDA=0");
        return;
    }
    char path[4096];
    library_path(path, sizeof path);
    if (strchr(path, '/') && access(path, R_OK) != 0) {
        snprintf(g_reason, sizeof g_reason,
                 "%s was not built (the build found no nvcc, or KVC_CUDA=0 was set; rebuild with nvcc on PATH)", path);
        return;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(g_reason, sizeof g_reason, "cannot open %s: %s", path, e ? e : "unknown error");
        return;
    }
    kvc_cuda_get_api_fn get = (kvc_cuda_get_api_fn)dlsym(h, KVC_CUDA_GET_API);
    const kvc_cuda_api *api = get ? get() : NULL;
    if (!api) {
        snprintf(g_reason, sizeof g_reason, "%s does not export %s", path, KVC_CUDA_GET_API);
        dlclose(h);
        return;
    }
    if (api->version != KVC_CUDA_API_VERSION) {
        snprintf(g_reason, sizeof g_reason, "%s has interface version %d, this core expects %d: rebuild both", path,
                 api->version, KVC_CUDA_API_VERSION);
        dlclose(h);
        return;
    }
    if (api->init(&g_host) != KVC_OK) {
        /* keep the library mapped: its CUDA runtime state may have registered callbacks */
        snprintf(g_reason, sizeof g_reason, "%s", kvc_last_error());
        return;
    }
    g_api = api;
}

kvc_status kvc_cuda_api_get(const kvc_cuda_api **out) {
    pthread_once(&g_once, load_once);
    *out = g_api;
    if (!g_api) return kvc_fail(KVC_ERR_DEVICE, "CUDA backend not available: %s", g_reason);
    return KVC_OK;
}

int kvc_cuda_available(void) {
    pthread_once(&g_once, load_once);
    return g_api != NULL;
}

kvc_status kvc_cuda_init(void) {
    const kvc_cuda_api *a;
    return kvc_cuda_api_get(&a);
}

const char *kvc_cuda_device_name(void) { return kvc_cuda_available() ? g_api->device_name() : ""; }
const char *kvc_cuda_gemm_name(void) { return kvc_cuda_available() ? g_api->gemm_name() : ""; }

kvc_status kvc_cuda_memory_stats(int64_t *out) {
    const kvc_cuda_api *a;
    if (!out) return kvc_fail(KVC_ERR_ARG, "memory_stats: out is NULL");
    KVC_TRY(kvc_cuda_api_get(&a));
    a->memory_stats(out);
    return KVC_OK;
}

kvc_status kvc_cuda_reset_peak(void) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    a->reset_peak();
    return KVC_OK;
}

kvc_status kvc_cuda_force_builtin_gemm(int on) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    a->force_builtin_gemm(on);
    return KVC_OK;
}

kvc_status kvc_cuda_set_attention_kernel(int kind) {
    const kvc_cuda_api *a;
    if (kind != 0 && kind != 1) return kvc_fail(KVC_ERR_ARG, "attention kernel must be 0 (wmma) or 1 (mma), got %d", kind);
    KVC_TRY(kvc_cuda_api_get(&a));
    a->set_attention_kernel(kind);
    return KVC_OK;
}

/* ---- models on the device ------------------------------------------------------------------------ */

void kvc_cuda_model_release(kvc_model *m) {
    if (m && m->cuda && g_api) g_api->model_free(m->cuda);
    if (m) m->cuda = NULL;
}

kvc_status kvc_model_load_device(const char *path, int32_t device, kvc_model **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_model_load_device: out is NULL");
    *out = NULL;
    if (device != KVC_DEVICE_CPU && device != KVC_DEVICE_CUDA)
        return kvc_fail(KVC_ERR_ARG, "unknown device %d (0: cpu, 1: cuda)", device);
    const kvc_cuda_api *a = NULL;
    if (device == KVC_DEVICE_CUDA) KVC_TRY(kvc_cuda_api_get(&a)); /* fail before reading the file */
    kvc_model *m = NULL;
    KVC_TRY(kvc_model_load(path, &m));
    if (device == KVC_DEVICE_CUDA) {
        kvc_status st = a->model_upload(m, &m->cuda);
        if (st != KVC_OK) {
            m->cuda = NULL;
            kvc_model_free(m);
            return st;
        }
    }
    *out = m;
    return KVC_OK;
}

int32_t kvc_model_device(const kvc_model *m) { return m && m->cuda ? KVC_DEVICE_CUDA : KVC_DEVICE_CPU; }

/* ---- kernels on host arrays (the checks of backend/cpu/kernels_api.c, then the device) ------------ */

#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) return kvc_fail(KVC_ERR_ARG, __VA_ARGS__); \
    } while (0)

kvc_status kvc_cuda_kernel_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    CHECK(a && b && c, "matmul: a, b and c must not be NULL");
    CHECK(m > 0 && n > 0 && k > 0, "matmul: sizes must be positive (m=%lld n=%lld k=%lld)", (long long)m, (long long)n,
          (long long)k);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_matmul(a, b, c, m, n, k);
}

kvc_status kvc_cuda_kernel_rmsnorm(const float *x, const float *r, const float *w, float *y, float *x_out, int64_t rows,
                                   int64_t dim, float eps) {
    CHECK(x && w && y, "rmsnorm: x, w and y must not be NULL");
    CHECK(rows > 0 && dim > 0, "rmsnorm: sizes must be positive (rows=%lld dim=%lld)", (long long)rows, (long long)dim);
    CHECK(eps > 0 && isfinite(eps), "rmsnorm: eps must be finite and > 0 (got %g)", (double)eps);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_rmsnorm(x, r, w, y, x_out, rows, dim, eps);
}

kvc_status kvc_cuda_kernel_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d,
                                const float *inv_freq, int32_t pairing) {
    CHECK(x && pos && inv_freq, "rope: x, pos and inv_freq must not be NULL");
    CHECK(n > 0 && heads > 0, "rope: sizes must be positive (n=%lld heads=%d)", (long long)n, heads);
    CHECK(d >= 2 && d % 2 == 0 && d <= 1024, "rope: head_dim must be even and in [2, 1024] (got %d)", d);
    CHECK(pairing == KVC_ROPE_HALF || pairing == KVC_ROPE_ADJACENT, "rope: pairing must be 0 or 1, got %d", pairing);
    for (int64_t i = 0; i < n; i++) CHECK(pos[i] >= 0, "rope: position %lld is negative", (long long)i);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_rope(x, pos, n, heads, d, inv_freq, pairing);
}

kvc_status kvc_cuda_kernel_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    CHECK(gate && up && out, "swiglu: gate, up and out must not be NULL");
    CHECK(rows > 0 && dim > 0, "swiglu: sizes must be positive (rows=%lld dim=%lld)", (long long)rows, (long long)dim);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_swiglu(gate, up, out, rows, dim);
}

kvc_status kvc_cuda_kernel_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                     const float *const *k, const float *const *v, const int64_t *past_len,
                                     float scale, float *out, int32_t force_prefill) {
    CHECK(q && k && v && past_len && out, "attention: q, k, v, past_len and out must not be NULL");
    CHECK(n > 0 && H > 0 && Hkv > 0 && d > 0, "attention: sizes must be positive (n=%lld H=%d Hkv=%d d=%d)",
          (long long)n, H, Hkv, d);
    CHECK(H % Hkv == 0, "attention: the query heads H=%d must be a multiple of the KV heads Hkv=%d", H, Hkv);
    CHECK(d <= 256 && d % 8 == 0, "attention: head_dim %d must be a multiple of 8, at most 256, on the GPU", d);
    CHECK(isfinite(scale), "attention: scale must be finite");
    for (int32_t h = 0; h < Hkv; h++) {
        CHECK(k[h] && v[h], "attention: k[%d] or v[%d] is NULL", h, h);
        CHECK(past_len[h] >= 0 && past_len[h] + n < 2147483647, "attention: past_len[%d] = %lld is out of range", h,
              (long long)past_len[h]);
    }
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_attention(q, n, H, Hkv, d, k, v, past_len, scale, out, force_prefill);
}

kvc_status kvc_cuda_bench(int32_t what, const int64_t *dims, int32_t reps, double *seconds) {
    CHECK(dims && seconds, "bench: null argument");
    const int nd = what == 1 ? 4 : 3;
    for (int i = 0; i < nd; i++) CHECK(dims[i] > 0 && dims[i] < (1LL << 31), "bench: dimension %d out of range", i);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->bench(what, dims, reps, seconds);
}

kvc_status kvc_cuda_kernel_topk(const float *scores, int32_t heads, int64_t n, const int64_t *k, int64_t *keep) {
    CHECK(scores && k && keep, "topk: null argument");
    CHECK(heads > 0 && n > 0 && n < 2147483647, "topk: bad sizes (heads=%d n=%lld)", heads, (long long)n);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    return api->k_topk(scores, heads, n, k, keep);
}

kvc_status kvc_cuda_press_compute(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                                  int32_t n_layers, const float *q, int64_t n, const float *k, const float *v,
                                  int64_t len, float *scores, int64_t *keep, int64_t *n_keep) {
    return kvc_cuda_press_compute_ex(cfg, H, Hkv, d, layer, n_layers, q, NULL, n, k, v, len, -1, scores, keep, n_keep);
}

kvc_status kvc_cuda_press_compute_ex(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                                     int32_t n_layers, const float *q, const float *attn, int64_t n, const float *k,
                                     const float *v, int64_t len, int64_t layer_total, float *scores, int64_t *keep,
                                     int64_t *n_keep) {
    CHECK(cfg && q && k && v && scores && keep && n_keep, "press_compute: null argument");
    KVC_TRY(kvc_press_validate(cfg));
    CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && d > 0 && d % 8 == 0 && d <= 256 && Hkv <= 64,
          "press_compute: bad head shape H=%d Hkv=%d d=%d (the GPU takes head_dim a multiple of 8, at most 256)", H,
          Hkv, d);
    CHECK(n >= 1 && len >= n, "press_compute: need 1 <= n (%lld) <= len (%lld)", (long long)n, (long long)len);
    CHECK(layer >= 0 && layer < n_layers, "press_compute: layer %d not in [0, %d)", layer, n_layers);
    const int32_t w = kvc_scorer_has_window(cfg->scorer) ? cfg->window : 0;
    CHECK(w == 0 || n > w, "the prompt (%lld tokens) must be longer than the press window (%d)", (long long)n, w);
    const kvc_cuda_api *api;
    KVC_TRY(kvc_cuda_api_get(&api));
    KVC_TRY(api->k_score(cfg, H, Hkv, d, layer, q, attn, n, k, v, len, scores));
    int64_t lens[64];
    const float *sp[64];
    int64_t *kp[64];
    for (int32_t h = 0; h < Hkv; h++) {
        lens[h] = len;
        sp[h] = scores + (size_t)h * len;
        kp[h] = keep + (size_t)h * len;
    }
    return kvc_press_select(cfg, layer, n_layers, Hkv, lens, sp, w, layer_total, kp, n_keep);
}
