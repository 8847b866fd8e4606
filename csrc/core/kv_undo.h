/* KIVI's undo rows: a failed call on a KIVI store loses nothing (issue 27), the rule both K/V stores keep
 * (backend/cpu/kv_store.c, backend/cuda/kv_typed.cu).
 *
 * The engine undoes a failed call by cutting every layer back to its length before the call (kv_set_lens). Rows
 * stored alone lose nothing by that, but a KIVI commit quantises rows of earlier calls that waited in f32 (the
 * residual) together with the call's own. So a KIVI store keeps per head
 *   mark     the length before the last append (kv_append, or a kv_write past the rows held: RestoreKV's); -1: none;
 *   u0, un   the undo rows: f32 copies of rows [u0, u0 + un), those that waited before that append and its commit
 *            quantised (fewer than max(residual, group) after a commit; kept by the first commit that does);
 * a cut back to mark takes rows [u0, u0 + un) back to f32 as they were, not as decoded. An append drops the undo
 * rows; any other cut, or a move of the rows (a rebuild, ThinK), drops them with the mark.
 *
 * Plain C, static inline: included by C and CUDA translation units (the CUDA commit keeps the undo rows on the
 * device, so a decode graph's replays keep them too). */
#ifndef KVC_KV_UNDO_H
#define KVC_KV_UNDO_H

#include <stdint.h>

#include "kv_type.h"

/* A commit about to quantise rows [nq, nq + m): how many of them waited before the last append (mark) and are
 * kept as undo rows, from row nq; 0 when undo rows are held already (an earlier commit after that append). */
KVC_KVT_FN int64_t kvc_kivi_undo_rows(int64_t mark, int64_t nq, int64_t m, int64_t un) {
    const int64_t pre = mark - nq < m ? mark - nq : m;
    return un > 0 || pre <= 0 ? 0 : pre;
}

/* A cut of a head holding `held` rows, nq of them in the type, to len rows. */
typedef struct kvc_kivi_cut {
    int64_t r0;     /* the first row going back to f32, a key block's start (nq: none) */
    int64_t ua, ub; /* rows [ua, ub) of those come back from the undo rows (a cut back to mark); ua == ub: none */
    int keep;       /* the mark and the undo rows stay (a cut that moves none of their rows) */
} kvc_kivi_cut;

KVC_KVT_FN kvc_kivi_cut kvc_kivi_cut_to(int64_t len, int64_t held, int64_t nq, int32_t group, int64_t mark, int64_t u0,
                                        int64_t un) {
    kvc_kivi_cut c;
    const int roll_back = mark >= 0 && len == mark; /* to before the last append: as it was */
    c.r0 = len < nq ? len / group * group : nq;
    c.ua = c.ub = 0;
    if (roll_back && un > 0) {
        c.r0 = u0 < c.r0 ? u0 : c.r0;
        c.ua = u0;
        c.ub = u0 + un < nq ? u0 + un : nq;
    }
    c.keep = !roll_back && len >= held;
    return c;
}

/* The mark after a write whose lowest row is lo into a head holding `held` rows: rows written past the held ones
 * are an append (a roll-back to held cuts them); a write into the held rows leaves nothing to roll back to. */
KVC_KVT_FN int64_t kvc_kivi_write_mark(int64_t lo, int64_t held) { return lo >= held ? held : -1; }

#endif
