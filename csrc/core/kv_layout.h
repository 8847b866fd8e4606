/* The layout rules of a layer's K/V store, one home for every backend (core/backend.h, "Key-channel
 * pruning"). Per head one block of the arena:
 *   Kp [np, dk]      the pruned prefix: rows r < np keep their dk kept channels only (ThinK's freed keys)
 *   K  [cap - np, d] the full key rows r >= np, row r at (r - np) d
 *   V  [cap, d]      every row's value
 * each slice rounded up to the backend's alignment. The row rules (kvc_kv_rows_refused): rows read,
 * gathered or carried by a resize lie inside the rows the store holds (its lengths, which the core keeps
 * and the device follows: the cache layer checks compactions against them and reads [0, len)); rows
 * written lie inside its capacity (kvc_cache_append_host writes past the lengths, then sets them).
 * Static inline, so the CUDA files use the same functions (the layout ones on the device too). */
#ifndef KVC_KV_LAYOUT_H
#define KVC_KV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#if defined(__CUDACC__)
#define KVC_KVL_FN __host__ __device__ static inline
#else
#define KVC_KVL_FN static inline
#endif

/* Bytes of a slice of rows x width elements of es bytes, rounded up to align (a power of two). */
KVC_KVL_FN size_t kvc_kv_slice_bytes(size_t es, int32_t width, int64_t rows, size_t align) {
    return ((size_t)rows * (size_t)width * es + align - 1) & ~(align - 1);
}

/* A head's block: byte offsets of Kp, K and V inside it, and its size. */
typedef struct kvc_kv_slices {
    size_t kp, k, v, bytes;
} kvc_kv_slices;

KVC_KVL_FN kvc_kv_slices kvc_kv_head_slices(size_t es, int32_t d, int32_t dk, int64_t cap, int64_t np, size_t align) {
    kvc_kv_slices s;
    s.kp = 0;
    s.k = kvc_kv_slice_bytes(es, dk, np, align);
    s.v = s.k + kvc_kv_slice_bytes(es, d, cap - np, align);
    s.bytes = s.v + kvc_kv_slice_bytes(es, d, cap, align);
    return s;
}

/* Row r's full key row index inside K (r >= np). */
KVC_KVL_FN int64_t kvc_kv_full_row(int64_t r, int64_t np) { return r - np; }

/* Pruned rows after a resize keeping rows [0, rows): the prefix shrinks with them. */
KVC_KVL_FN int64_t kvc_kv_resized_pruned(int64_t rows, int64_t np) { return rows < np ? rows : np; }

/* Pruned rows after a gather of the increasing rows keep[0, n): kept rows of the prefix stay pruned (and a
 * prefix still, since keep increases). */
KVC_KVL_FN int64_t kvc_kv_gathered_pruned(const int64_t *keep, int64_t n, int64_t np) {
    int64_t p = 0;
    while (p < n && keep[p] < np) p++;
    return p;
}

/* What a row range is checked for. */
typedef enum kvc_kv_op { KVC_KV_READ, KVC_KV_WRITE, KVC_KV_GATHER, KVC_KV_RESIZE } kvc_kv_op;

/* The one check of the row ranges a K/V store is asked to move, for head h of Hkv:
 *   KVC_KV_READ   rows [row0, row0 + rows) inside the held rows [0, held)
 *   KVC_KV_WRITE  rows [row0, row0 + rows) inside the capacity [0, cap)
 *   KVC_KV_GATHER the `rows` strictly increasing rows keep[] inside [0, held), into a capacity cap >= rows
 *   KVC_KV_RESIZE rows [0, rows) of the source's [0, held) carried into a capacity cap >= rows
 * 0 when allowed; otherwise 1 and why (a sentence naming the operation, head and bounds). */
static inline int kvc_kv_rows_refused(kvc_kv_op op, int32_t h, int32_t Hkv, int64_t row0, int64_t rows,
                                      const int64_t *keep, int64_t held, int64_t cap, char *why, size_t why_n) {
    static const char *const name[] = {"K/V read", "K/V write", "K/V gather", "K/V resize"};
    const char *what = name[op];
    if (h < 0 || h >= Hkv) {
        snprintf(why, why_n, "%s: head %d of a store of %d heads", what, h, Hkv);
        return 1;
    }
    if (op == KVC_KV_READ || op == KVC_KV_WRITE) {
        const int64_t lim = op == KVC_KV_READ ? held : cap;
        if (row0 < 0 || rows < 0 || row0 > lim || rows > lim - row0) {
            snprintf(why, why_n, "%s: rows [%lld, %lld) of head %d are outside the %lld rows it %s", what, (long long)row0,
                     (long long)(row0 + rows), h, (long long)lim, op == KVC_KV_READ ? "holds" : "has room for");
            return 1;
        }
        return 0;
    }
    if (rows < 0 || rows > held || rows > cap) {
        snprintf(why, why_n, "%s: head %d keeps %lld rows of the %lld it holds, into room for %lld", what, h,
                 (long long)rows, (long long)held, (long long)cap);
        return 1;
    }
    for (int64_t i = 0; op == KVC_KV_GATHER && i < rows; i++)
        if (keep[i] < 0 || keep[i] >= held || (i > 0 && keep[i] <= keep[i - 1])) {
            snprintf(why, why_n, "%s: head %d rows are not increasing inside the %lld rows it holds (row %lld at %lld)",
                     what, h, (long long)held, (long long)keep[i], (long long)i);
            return 1;
        }
    return 0;
}

#endif
