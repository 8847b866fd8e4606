/* The registry of backends: the table of each device (the CPU and the emulated device are built in;
 * the CUDA library is opened on first use by cuda_loader.c) and the lock that serialises a device whose
 * calls must take turns (one stream, shared scratch). */
#include <pthread.h>

#include "backend.h"
#include "common.h"

const kvc_backend *kvc_backend_emulated(void); /* emulated/emulated.c */
kvc_status kvc_cuda_backend(const kvc_backend **out); /* cuda_loader.c */

kvc_status kvc_backend_get(int32_t device, const kvc_backend **out) {
    *out = NULL;
    switch (device) {
    case KVC_DEVICE_CPU: *out = kvc_backend_cpu(); return KVC_OK;
    case KVC_DEVICE_EMULATED: *out = kvc_backend_emulated(); return KVC_OK;
    case KVC_DEVICE_CUDA: return kvc_cuda_backend(out);
    default: return kvc_fail(KVC_ERR_ARG, "unknown device %d (0: cpu, 1: cuda, 2: emulated)", device);
    }
}

static pthread_mutex_t g_locks[3];
static pthread_once_t g_locks_once = PTHREAD_ONCE_INIT;

static void locks_init(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE); /* a hook inside a forward calls back in */
    for (int i = 0; i < 3; i++) pthread_mutex_init(&g_locks[i], &a);
    pthread_mutexattr_destroy(&a);
}

void kvc_backend_lock(const kvc_backend *be) {
    if (!be->serialize || be->device < 0 || be->device > 2) return;
    pthread_once(&g_locks_once, locks_init);
    pthread_mutex_lock(&g_locks[be->device]);
}

void kvc_backend_unlock(const kvc_backend *be) {
    if (!be->serialize || be->device < 0 || be->device > 2) return;
    pthread_mutex_unlock(&g_locks[be->device]);
}
