/* The typed K/V store's layout changes (kv_typed.cu has the store): growth and copies (kv_resize), compaction
 * (kv_gather: a new arena sized for the kept rows, the memory really drops), ThinK (kv_prune_keys) and truncation
 * (kv_set_lens), with backend/cpu/kv_store.c's rules. Rows stored alone are committed first and copied as stored
 * where their key layout stays, else decoded and encoded again (narrow to the kept channels where pruned); KIVI
 * copies the whole key blocks of a kept prefix, stages every other kept row in f32 and applies kv_commit's rule,
 * keeps its width under ThinK (the dropped channels' scale and min set to 0 in place), and turns blocks back into
 * staging rows when a cut falls below nq (a cut back to the length before the last append: its undo rows as they
 * were, core/kv_undo.h). Compile-only in this project's CI (no GPU). */
#include <stdlib.h>
#include <string.h>

#include "kv_typed.cuh"

namespace kvc {

/* a row's bytes (rows stored alone: f32, f16 and q8_0 rows are whole 2-byte units) */
__device__ __forceinline__ void copy_row(uint8_t *dst, const uint8_t *src, uint64_t bytes) {
    for (uint64_t i = 0; i < bytes / 2; i++) ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
}

/* a new layout's slices (rows stored alone), and what its keys keep */
struct RebuildDst {
    uint8_t *k[KVC_MAX_KV], *v[KVC_MAX_KV], *kp[KVC_MAX_KV];
    int64_t np[KVC_MAX_KV];
    int32_t same[KVC_MAX_KV]; /* head h keeps the kept channels of `from`: its pruned rows copy as stored */
    int32_t dk;
    uint64_t kprow;
    const int32_t *inv; /* the new channel map [Hkv d] */
};

/* Rows stored alone into a new layout, one row a thread: values and keys whose layout stays copied as stored,
 * other keys decoded (pruned channels zero) and encoded again, narrow to the new kept channels where pruned. */
__global__ void rebuild_rows_kernel(const TypedRows from, const RowList L, int32_t Hkv, const RebuildDst dst) {
    const int32_t d = from.d;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < L.off[Hkv]; it += (int64_t)gridDim.x * blockDim.x) {
        const int h = L.head_of(it, Hkv);
        const int64_t i = it - L.off[h], s = L.row(h, it);
        const TypedRows::Head src = from.head(h, d);
        copy_row(dst.v[h] + i * from.vrow, src.v + s * from.vrow, from.vrow);
        const int sp = s < src.np, dp = i < dst.np[h];
        if (!sp && !dp) {
            copy_row(dst.k[h] + (i - dst.np[h]) * from.krow, src.k + (s - src.np) * from.krow, from.krow);
        } else if (sp && dp && dst.same[h]) {
            copy_row(dst.kp[h] + i * dst.kprow, src.kp + s * src.kprow, dst.kprow);
        } else {
            float row[256], nar[256];
            src.key_n(s, 0, d, row);
            if (dp) {
                const int32_t *inv = dst.inv + (size_t)h * d;
                for (int c = 0; c < d; c++)
                    if (inv[c] >= 0) nar[inv[c]] = row[c];
                kvc_kv_encode_row(&from.f, nar, dst.dk, dst.kp[h] + i * dst.kprow);
            } else {
                kvc_kv_encode_row(&from.f, row, d, dst.k[h] + (i - dst.np[h]) * from.krow);
            }
        }
    }
}

/* KIVI ThinK: in the blocks below nq the dropped channels' scale and min become 0 (their codes then read 0), in
 * the staging rows the values; nothing else moves (kv_store.c's prune_blocks). */
__global__ void prune_blocks_kernel(const TypedRows t, const int32_t *__restrict__ len) {
    const int h = blockIdx.y;
    const int32_t d = t.d;
    const TypedRows::Head hd = t.head(h, d);
    const int64_t nb = hd.nq / t.f.group, items = (nb + ((int64_t)len[h] - hd.nq)) * d;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items; it += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(it % d);
        if (hd.inv[c] >= 0) continue;
        if (it < nb * d) {
            uint16_t *par = (uint16_t *)(t.tab->k[h] + (it / d) * t.kblock);
            par[c] = 0;
            par[d + c] = 0;
        } else {
            t.tab->st[h][(it / d - nb) * 2 * d + c] = 0.f;
        }
    }
}

/* the channel map of dk kept channels kidx [Hkv dk] (channel -> slot, or -1) */
static void channel_map(int32_t Hkv, int32_t d, int32_t dk, const int32_t *kidx, int32_t *inv) {
    for (int32_t h = 0; h < Hkv; h++) {
        for (int32_t c = 0; c < d; c++) inv[(size_t)h * d + c] = -1;
        for (int32_t j = 0; j < dk; j++) inv[(size_t)h * d + kidx[(size_t)h * dk + j]] = j;
    }
}

/* ---- rebuilds ---- */

static kvc_kv_slices typed_slices(const kvc_kv *kv, int32_t dk, int64_t cap, int64_t np) {
    const kvc_kv_format *f = &kv->fmt;
    if (kvt_kivi(kv)) np = 0;
    const size_t a = KV_ALIGN - 1;
    kvc_kv_slices s;
    s.kp = 0;
    s.k = ((size_t)np * (dk > 0 ? kvc_kv_row_bytes(f, dk) : 0) + a) & ~a;
    s.v = s.k + ((kvc_kv_key_bytes(f, kv->d, cap - np) + a) & ~a);
    s.bytes = s.v + (((size_t)cap * kv->vrow + a) & ~a);
    return s;
}

/* kv's new arena of cap[h] rows a head holds, per head, rows [0, n[h]) of from (keep NULL) or rows
 * keep[h][0 .. n[h]) (increasing), the first np_in[h] pruned to the dk channels kidx (dk 0: none); lengths n.
 * The old arena goes (memory really drops). commit: KIVI applies kv_commit's rule to the rows it staged. */
static kvc_status rebuild(kvc_kv *kv, kvc_kv *from, const int64_t *cap, const int64_t *const *keep, const int64_t *n,
                          const int64_t *np_in, int32_t dk, const int32_t *kidx) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    const int kb = kvt_kivi(kv);
    if (!kb) KVC_TRY(kvt_commit(from)); /* every row in the type: copied as stored */
    int64_t np[KVC_MAX_KV], whole[KVC_MAX_KV], any = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        np[h] = dk ? np_in[h] : 0;
        any += np[h];
        whole[h] = 0;
        if (cap[h] < 0 || cap[h] >= 2147483647 || n[h] < 0 || n[h] > cap[h] || np[h] > n[h])
            return fail(KVC_ERR_INTERNAL, "K/V rebuild: head %d holds %lld rows (%lld pruned) in %lld", h, (long long)n[h],
                        (long long)np[h], (long long)cap[h]);
    }
    if (!any) dk = 0; /* nothing pruned any more: the plain layout */
    if (kb && !keep) { /* whole blocks of a kept prefix are copied as stored */
        int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV];
        KVC_TRY(kvt_state_get(from, held, nq));
        for (int32_t h = 0; h < Hkv; h++) whole[h] = (n[h] < nq[h] ? n[h] : nq[h]) / kv->fmt.group * kv->fmt.group;
    }
    /* the new channel map and kept channels (host copies first: kidx may be the store's own, freed below) */
    int32_t *ixc = dk ? (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * dk) : nullptr;
    int32_t *inv = dk ? (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * d) : nullptr;
    if (dk && (!ixc || !inv)) {
        free(ixc);
        free(inv);
        return fail(KVC_ERR_NOMEM, "out of memory: K/V rebuild");
    }
    if (dk) {
        memcpy(ixc, kidx, sizeof(int32_t) * (size_t)Hkv * dk);
        channel_map(Hkv, d, dk, ixc, inv);
    }
    /* the rows each head takes: rows stored alone all of them, KIVI those past its whole blocks */
    int64_t cnt[KVC_MAX_KV], most = 0, rows_held = 0;
    const int64_t *rows_of[KVC_MAX_KV];
    for (int32_t h = 0; h < Hkv; h++) {
        cnt[h] = n[h] - whole[h];
        most = cnt[h] > most ? cnt[h] : most;
        rows_held += n[h];
        rows_of[h] = keep ? keep[h] + whole[h] : nullptr;
    }
    RowList L;
    const int32_t *inv_d = nullptr;
    kvc_status st = kvt_list_put(kv, keep ? rows_of : nullptr, cnt, inv, &L, &inv_d);
    for (int32_t h = 0; h < Hkv; h++) L.first[h] = whole[h];
    /* the arena (and KIVI's staging rows) */
    size_t bytes = 0, sbytes = 0;
    for (int32_t h = 0; h < Hkv; h++) bytes += typed_slices(kv, dk, cap[h], np[h]).bytes;
    /* staging rows: an empty store has none (a cleared cache holds nothing); KIVI's new ones hold its staged rows
     * and the room of the appends to come (a graph's capture must not grow them); rows stored alone keep theirs */
    const int64_t scap = !rows_held ? 0 : kb ? (most > kvt_stage_keep(kv) ? most : kvt_stage_keep(kv)) : kv->scap;
    void *arena = nullptr;
    float *stage = nullptr;
    if (st == KVC_OK && bytes) st = dalloc(&arena, bytes, MEM_CACHE, "KV cache");
    if (st == KVC_OK && kb && scap) {
        sbytes = sizeof(float) * 2 * (size_t)d * (size_t)Hkv * (size_t)scap;
        st = dalloc((void **)&stage, sbytes, MEM_CACHE, "K/V staging rows");
    }
    const KvTab old = kv->tabh;
    KvTab nt = kv->tabh;
    RebuildDst dst;
    memset(&dst, 0, sizeof dst);
    size_t off = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const kvc_kv_slices sl = typed_slices(kv, dk, cap[h], np[h]);
        uint8_t *base = (uint8_t *)arena + off;
        off += sl.bytes;
        nt.k[h] = dst.k[h] = bytes ? base + sl.k : nullptr;
        nt.v[h] = dst.v[h] = bytes ? base + sl.v : nullptr;
        nt.kp[h] = dst.kp[h] = bytes && dk && !kb ? base + sl.kp : nullptr;
        nt.np[h] = (int32_t)np[h];
        dst.np[h] = kb ? 0 : np[h];
        dst.same[h] = dk && from->dk == dk && !memcmp(from->kidx + (size_t)h * dk, ixc + (size_t)h * dk, sizeof(int32_t) * dk);
        if (kb || !scap) nt.st[h] = stage ? stage + (size_t)h * scap * 2 * d : nullptr;
    }
    nt.dk = dk;
    nt.kprow = dk && !kb ? kvc_kv_row_bytes(&kv->fmt, dk) : 0;
    dst.dk = dk;
    dst.kprow = nt.kprow;
    dst.inv = inv_d;
    const TypedRows src = typed_rows(from);
    if (st == KVC_OK && kb) {
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            if (whole[h] == 0) continue;
            if (cudaMemcpyAsync(nt.k[h], from->tabh.k[h], (size_t)(whole[h] / kv->fmt.group) * kv->kblock,
                                cudaMemcpyDeviceToDevice, g.stream) != cudaSuccess ||
                cudaMemcpyAsync(nt.v[h], from->tabh.v[h], (size_t)whole[h] * kv->vrow, cudaMemcpyDeviceToDevice, g.stream) !=
                    cudaSuccess)
                st = cuda_fail(cudaGetLastError(), "K/V rebuild");
        }
        if (st == KVC_OK) st = kvt_rows_to_staging(from, L, nt.st);
    } else if (st == KVC_OK && L.off[Hkv] > 0) {
        rebuild_rows_kernel<<<kvt_blocks(L.off[Hkv]), KVT_THREADS, 0, g.stream>>>(src, L, Hkv, dst);
        st = check_launch("K/V rebuild");
    }
    /* the store's table and state follow (stream order: after the kernels read from's) */
    if (st == KVC_OK) {
        kv->tabh = nt;
        st = kvt_tab_put(kv);
    }
    if (st == KVC_OK && dk && cudaMemcpyAsync(kv->tabh.inv, inv_d, sizeof(int32_t) * (size_t)Hkv * d, cudaMemcpyDeviceToDevice,
                                              g.stream) != cudaSuccess)
        st = cuda_fail(cudaGetLastError(), "K/V channel map");
    if (st == KVC_OK) st = kvt_ints_put(kvt_nq_dev(kv), kb ? whole : n, Hkv, "K/V state");
    if (st == KVC_OK) st = kvt_ints_put(kv->lend, n, Hkv, "K/V lengths");
    if (st == KVC_OK) st = kvt_undo_forget(kv); /* the rows moved: nothing to roll back to */
    free(inv);
    if (st != KVC_OK) { /* the store keeps its old arena and table */
        stream_wait();
        kv->tabh = old;
        kvt_tab_put(kv);
        if (arena) dfree(arena, bytes, MEM_CACHE);
        if (stage) dfree(stage, sbytes, MEM_CACHE);
        free(ixc);
        return st;
    }
    if (kv->arena) dfree(kv->arena, kv->bytes, MEM_CACHE);
    kv->arena = arena;
    kv->bytes = bytes;
    if (kb || !scap) {
        if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
        kv->stage = stage;
        kv->scap = scap;
        kv->sbytes = sbytes;
    }
    for (int32_t h = 0; h < Hkv; h++) {
        kv->cap[h] = cap[h];
        kv->np[h] = np[h];
    }
    free(kv->kidx);
    kv->kidx = ixc;
    kv->dk = dk;
    kv->wait_max = kb ? most : 0;
    return kb ? kvt_commit(kv) : KVC_OK;
}

kvc_status kvt_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src) {
    kvc_kv *from = src ? (kvc_kv *)src : kv; /* a copy of a cache reads `from` only (its staging rows may commit) */
    int64_t np[KVC_MAX_KV];
    for (int32_t h = 0; h < kv->Hkv; h++) np[h] = kvc_kv_resized_pruned(rows[h], from->np[h]); /* the pruned prefix goes along */
    return rebuild(kv, from, cap, nullptr, rows, np, from->dk, from->kidx);
}

kvc_status kvt_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap) {
    int64_t np[KVC_MAX_KV];
    for (int32_t h = 0; h < kv->Hkv; h++) np[h] = kvc_kv_gathered_pruned(keep[h], n_keep[h], kv->np[h]); /* kept rows stay pruned */
    return rebuild(kv, kv, cap, keep, n_keep, np, kv->dk, kv->kidx);
}

kvc_status kvt_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV], cap[KVC_MAX_KV];
    if (!kvt_kivi(kv)) { /* every row held becomes a narrow row: a new arena */
        KVC_TRY(kvt_commit(kv));
        KVC_TRY(kv_host_lens(kv, held));
        for (int32_t h = 0; h < Hkv; h++) cap[h] = kv->cap[h];
        return rebuild(kv, kv, cap, nullptr, held, held, dk, kidx);
    }
    /* KIVI keeps the width: the dropped channels become zeros in place (channels dropped before are zeros already) */
    int32_t *ixc = (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * dk), *inv = (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * d);
    kvc_status st = !ixc || !inv ? fail(KVC_ERR_NOMEM, "out of memory: K/V prune") : kvt_state_get(kv, held, nq);
    if (st == KVC_OK) {
        memcpy(ixc, kidx, sizeof(int32_t) * (size_t)Hkv * dk);
        channel_map(Hkv, d, dk, ixc, inv);
        if (h2d(kv->tabh.inv, inv, sizeof(int32_t) * (size_t)Hkv * d) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "K/V channel map");
    }
    int64_t most = 0;
    for (int32_t h = 0; h < Hkv; h++) most = held[h] > most ? held[h] : most;
    if (st == KVC_OK && most > 0) {
        dim3 grid(kvt_blocks(most * d), (unsigned)Hkv);
        prune_blocks_kernel<<<grid, KVT_THREADS, 0, g.stream>>>(typed_rows(kv), kv->lend);
        st = check_launch("K/V prune");
    }
    if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) kv->tabh.np[h] = (int32_t)held[h];
        kv->tabh.dk = dk;
        st = kvt_tab_put(kv);
    }
    if (st == KVC_OK) st = kvt_undo_forget(kv); /* the keys changed: nothing to roll back to */
    free(inv);
    if (st != KVC_OK) {
        free(ixc);
        return st;
    }
    for (int32_t h = 0; h < Hkv; h++) kv->np[h] = held[h];
    free(kv->kidx);
    kv->kidx = ixc;
    kv->dk = dk;
    return KVC_OK;
}

kvc_status kvt_set_lens(kvc_kv *kv, const int64_t *len) {
    const int32_t Hkv = kv->Hkv;
    int into_pruned = 0;
    for (int32_t h = 0; h < Hkv; h++) into_pruned |= len[h] < kv->np[h];
    if (!kvt_kivi(kv)) {
        KVC_TRY(kvt_commit(kv));
        if (into_pruned) { /* the narrow prefix shrinks: later rows are full again, a new arena */
            int64_t np[KVC_MAX_KV], cap[KVC_MAX_KV];
            for (int32_t h = 0; h < Hkv; h++) {
                np[h] = len[h] < kv->np[h] ? len[h] : kv->np[h];
                cap[h] = kv->cap[h];
            }
            return rebuild(kv, kv, cap, nullptr, len, np, kv->dk, kv->kidx);
        }
        KVC_TRY(kvt_ints_put(kvt_nq_dev(kv), len, Hkv, "K/V state")); /* rows past the old length were written typed */
        kv->wait_max = 0;
        return kvt_ints_put(kv->lend, len, Hkv, "K/V lengths");
    }
    /* KIVI: rows cut below nq back to f32 from their block on; a cut back to the length before the last append
     * takes the rows of earlier calls its commit quantised from the undo rows (core/kv_undo.h) */
    int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV], r0[KVC_MAX_KV], mark[KVC_MAX_KV], u0[KVC_MAX_KV], un[KVC_MAX_KV];
    kvc_kivi_cut cut[KVC_MAX_KV];
    KVC_TRY(kvt_state_get(kv, held, nq));
    KVC_TRY(kvt_undo_get(kv, mark, u0, un));
    int back = 0;
    int64_t need = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        cut[h] = kvc_kivi_cut_to(len[h], held[h], nq[h], kv->fmt.group, mark[h], u0[h], un[h]);
        r0[h] = cut[h].r0;
        back |= r0[h] < nq[h];
        need = len[h] - r0[h] > need ? len[h] - r0[h] : need;
    }
    if (back) KVC_TRY(kvt_unquantise(kv, r0, held, need, cut, u0));
    for (int32_t h = 0; h < Hkv; h++)
        if (!cut[h].keep) {
            mark[h] = -1;
            un[h] = 0;
        }
    KVC_TRY(kvt_undo_set(kv, mark, un));
    KVC_TRY(kvt_stage_room(kv, need));
    int64_t pruned = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        kv->np[h] = len[h] < kv->np[h] ? len[h] : kv->np[h];
        kv->tabh.np[h] = (int32_t)kv->np[h];
        pruned += kv->np[h];
    }
    if (pruned == 0 && kv->dk) {
        free(kv->kidx);
        kv->kidx = nullptr;
        kv->dk = 0;
        kv->tabh.dk = 0;
    }
    KVC_TRY(kvt_tab_put(kv));
    kv->wait_max = need;
    return kvt_ints_put(kv->lend, len, Hkv, "K/V lengths");
}

} // namespace kvc
