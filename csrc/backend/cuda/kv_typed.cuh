/* Internal header of the typed K/V store (kv_typed.cu: the store, its staging rows, append and commit, host rows;
 * kv_typed_layout.cu: rebuilds, ThinK, truncation): what the two files share. */
#ifndef KVC_CUDA_KV_TYPED_CUH
#define KVC_CUDA_KV_TYPED_CUH

#include <stddef.h>

#include "../../core/kv_undo.h"
#include "kv_rows.cuh"

namespace kvc {

#define KVT_THREADS 256
#define KVT_MAX_BLOCKS 4096

static inline int kvt_kivi(const kvc_kv *kv) { return kvc_kv_type_key_blocks(kv->fmt.type); }
/* KIVI quantises once this many rows wait (max(residual, group)); rows stored alone always (0) */
static inline int64_t kvt_wait_limit(const kvc_kv *kv) {
    return kvt_kivi(kv) ? (kv->fmt.residual > kv->fmt.group ? kv->fmt.residual : kv->fmt.group) : 0;
}
/* staging rows a head keeps between calls: after a commit fewer than the limit wait, a decode step adds one */
static inline int64_t kvt_stage_keep(const kvc_kv *kv) { return kvt_wait_limit(kv) + 8; }
static inline unsigned kvt_blocks(int64_t items) {
    const int64_t b = (items + KVT_THREADS - 1) / KVT_THREADS;
    return (unsigned)(b < 1 ? 1 : b > KVT_MAX_BLOCKS ? KVT_MAX_BLOCKS : b);
}
static inline int32_t *kvt_nq_dev(const kvc_kv *kv) { return (int32_t *)((char *)kv->tabd + offsetof(KvTab, nq)); }
/* KIVI's undo state on the device: mark [KVC_MAX_KV], then u0, then un */
static inline int32_t *kvt_undo_dev(const kvc_kv *kv) { return (int32_t *)((char *)kv->tabd + offsetof(KvTab, mark)); }

/* Rows of every head, as the layout kernels walk them: head h has the list's entries [off[h], off[h + 1]), entry
 * `it` its row first[h] + (it - off[h]), or rows[it]. */
struct RowList {
    int64_t off[KVC_MAX_KV + 1];
    int64_t first[KVC_MAX_KV];
    const int32_t *rows;
    __device__ __forceinline__ int head_of(int64_t it, int32_t Hkv) const {
        int h = 0;
        while (h + 1 < Hkv && off[h + 1] <= it) h++;
        return h;
    }
    __device__ __forceinline__ int64_t row(int h, int64_t it) const { return rows ? rows[it] : first[h] + (it - off[h]); }
};

/* kv_typed.cu */
int kvt_capturing(void);
/* the host copy's fields before nq (pointers, np, dk) to the device; nq stays the device's */
kvc_status kvt_tab_put(kvc_kv *kv);
/* n values as int32 into device memory (nq, the lengths) */
kvc_status kvt_ints_put(int32_t *dst, const int64_t *v, int32_t n, const char *what);
/* the device lengths and nq, in one wait */
kvc_status kvt_state_get(const kvc_kv *kv, int64_t *len, int64_t *nq);
/* room for `rows` staging rows a head (grown by half again), every row held carried over */
kvc_status kvt_stage_room(kvc_kv *kv, int64_t rows);
/* the list of rows[h][0 .. n[h]) (rows NULL: first[h] + i, first set by the caller to 0) and an optional channel
 * map [Hkv d] in one upload (*inv_d its device copy) */
kvc_status kvt_list_put(const kvc_kv *kv, const int64_t *const *rows, const int64_t *n, const int32_t *inv, RowList *L,
                        const int32_t **inv_d);
/* the list's rows of `from` (8 channels a thread; pruned channels zero) into head h's staging rows st[h] (host
 * pointers: row it - off[h] of each, stride 2d) */
kvc_status kvt_rows_to_staging(const kvc_kv *from, const RowList &L, float *const *st);
/* KIVI: rows [r0[h], held[h]) of every head back to staging rows (r0 a block's start at or below nq), room for
 * `room` rows a head; nq becomes r0 (kv_store.c's unquantise_from). cut (NULL: none): a roll-back's rows
 * [cut[h].ua, cut[h].ub) come from the undo rows (u0: the device's) as they were, the others decoded. */
kvc_status kvt_unquantise(kvc_kv *kv, const int64_t *r0, const int64_t *held, int64_t room, const kvc_kivi_cut *cut,
                          const int64_t *u0);
/* KIVI's undo state (core/kv_undo.h) of every head from the device, in one wait */
kvc_status kvt_undo_get(const kvc_kv *kv, int64_t *mark, int64_t *u0, int64_t *un);
/* every head's mark and count of undo rows to the device */
kvc_status kvt_undo_set(kvc_kv *kv, const int64_t *mark, const int64_t *un);
/* the rows moved otherwise than by an append and its commit: no mark, no undo rows (kv_store.c's undo_forget) */
kvc_status kvt_undo_forget(kvc_kv *kv);

} // namespace kvc

#endif
