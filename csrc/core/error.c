/* Thread-local last-error message and checked allocation. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "common.h"

static _Thread_local char g_error[1024];

kvc_status kvc_fail(kvc_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    return st;
}

void kvc_clear_error(void) { g_error[0] = '\0'; }

const char *kvc_last_error(void) { return g_error; }

const char *kvc_version(void) { return KVC_VERSION; }

void *kvc_malloc(size_t bytes, const char *what) {
    if (bytes == 0) bytes = 1;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: %s needs %zu bytes", what, bytes);
        return NULL;
    }
    void *p = aligned_alloc(64, rounded);
    if (!p) kvc_fail(KVC_ERR_NOMEM, "out of memory: %s needs %zu bytes", what, bytes);
    return p;
}

void *kvc_malloc_huge(size_t bytes, const char *what) {
    const size_t huge = (size_t)2 << 20;
    if (bytes < 2 * huge) return kvc_malloc(bytes, what);
    void *p = NULL; /* posix_memalign: any size (aligned_alloc wants a multiple of the alignment) */
    if (posix_memalign(&p, huge, bytes) != 0) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: %s needs %zu bytes", what, bytes);
        return NULL;
    }
#if defined(MADV_HUGEPAGE)
    /* the whole 2 MiB pages inside only: a huge page past the end would hold memory the array never uses;
     * advice: where the kernel has no huge pages, p works as it is */
    madvise(p, bytes & ~(huge - 1), MADV_HUGEPAGE);
#endif
    return p;
}

void *kvc_calloc(size_t count, size_t size, const char *what) {
    size_t bytes;
    if (kvc_mul_ok(count, size, &bytes) != 0) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: %s needs %zu x %zu bytes", what, count, size);
        return NULL;
    }
    void *p = kvc_malloc(bytes, what);
    if (p) memset(p, 0, bytes);
    return p;
}

void kvc_free(void *p) { free(p); }
