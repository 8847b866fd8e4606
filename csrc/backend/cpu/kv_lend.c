/* Rows lent in place by the host stores (the CPU backend's f32, the emulated device's bf16): the backend table's
 * kv_rows, kv_keep_rows and kv_kept_free (core/backend.h). Written on host.h's store API, so the arena's layout
 * stays kv_store.c's business. */
#include "host.h"

int32_t kvc_hkv_rows(const kvc_kv *kv, int32_t h, const void **k, const void **v) {
    *k = *v = NULL;
    /* only a store of the rows' own type holds them plainly (a quantised store's rows are codes; nothing waits) */
    if (h < 0 || h >= kv->Hkv || kv->np[h] > 0 || !kv->direct || kv->nq[h] < kv->len[h]) return -1;
    *k = kv->k[h]; /* no pruned prefix: row r of K at row r of the slice */
    *v = kv->v[h];
    return kv->dtype;
}

/* The store continues in a copy of its rows (same capacities); the old store, arena and all, goes to the holder.
 * Swapping the structs keeps kv's address, which the cache and recorded graphs hold. */
kvc_status kvc_hkv_keep_rows(kvc_kv *kv, void **kept) {
    *kept = NULL;
    kvc_kv *copy;
    KVC_TRY(kvc_hkv_new(kv->stats, kv->dtype, &kv->fmt, kv->Hkv, kv->d, &copy));
    const kvc_status st = kvc_hkv_resize(copy, kv->cap, kv->len, kv);
    if (st != KVC_OK) {
        kvc_hkv_free(copy);
        return st;
    }
    const kvc_kv old = *kv;
    *kv = *copy;
    *copy = old;
    *kept = copy;
    return KVC_OK;
}

/* frees and atomic counters only: safe on any thread */
void kvc_hkv_kept_free(void *kept) { kvc_hkv_free(kept); }
