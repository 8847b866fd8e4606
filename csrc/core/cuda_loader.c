/* Run-time loader of the CUDA backend. libkvpress_c_cuda.so is looked for next to this library
 * (dladdr), or at $KVC_CUDA_LIB; it is opened once, on the first call that needs it, so a machine
 * without CUDA never touches it. Every failure (library missing, interface of another version, no
 * driver, no device, wrong architecture) becomes KVC_ERR_DEVICE with the reason; nothing aborts. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "backend.h"

kvc_status kvc_cuda_backend(const kvc_backend **out); /* for registry.c */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const kvc_backend *g_cuda;
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

static const kvc_host_services g_host = {host_fail};

static void library_path(char *out, size_t cap) {
    const char *env = getenv("KVC_CUDA_LIB");
    if (env && *env) {
        snprintf(out, cap, "%s", env);
        return;
    }
    Dl_info info;
    if (dladdr((void *)kvc_cuda_backend, &info) && info.dli_fname) {
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
    kvc_backend_version_fn version = (kvc_backend_version_fn)dlsym(h, KVC_CUDA_VERSION_SYMBOL);
    kvc_backend_open_fn open = (kvc_backend_open_fn)dlsym(h, KVC_CUDA_OPEN_SYMBOL);
    if (!version || !open) {
        snprintf(g_reason, sizeof g_reason, "%s does not export %s and %s", path, KVC_CUDA_VERSION_SYMBOL, KVC_CUDA_OPEN_SYMBOL);
        dlclose(h);
        return;
    }
    if (version() != KVC_BACKEND_VERSION) {
        snprintf(g_reason, sizeof g_reason, "%s has backend interface version %d, this core expects %d: rebuild both", path,
                 version(), KVC_BACKEND_VERSION);
        dlclose(h);
        return;
    }
    const kvc_backend *be = NULL;
    if (open(&g_host, &be) != KVC_OK || !be) {
        /* keep the library mapped: its CUDA runtime state may have registered callbacks */
        snprintf(g_reason, sizeof g_reason, "%s", kvc_last_error());
        return;
    }
    g_cuda = be;
}

kvc_status kvc_cuda_backend(const kvc_backend **out) {
    pthread_once(&g_once, load_once);
    *out = g_cuda;
    if (!g_cuda) return kvc_fail(KVC_ERR_DEVICE, "CUDA backend not available: %s", g_reason);
    return KVC_OK;
}
