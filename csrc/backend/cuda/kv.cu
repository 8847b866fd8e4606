/* K/V stores of the CUDA backend (struct kvc_kv in common.cuh): one arena per layer, bf16 heads
 * [cap, d], device tables of head pointers and lengths at fixed addresses. The core (cache/kv_cache.c)
 * decides sizes and keeps positions; this file moves rows. A store of another type (f32, f16, q8_0, KIVI) is
 * kv_typed.cu's: the entries here check the row rules, then hand it over. */
#include <string.h>

#include "common.cuh"

namespace kvc {

static Buf g_rows_d, g_stage; /* gather rows (device int32), row conversions */
static Pinned g_pinned;       /* the batched reads' and writes' host side */

kvc_status kv_new(int32_t Hkv, int32_t d, const kvc_kv_format *fmt, kvc_kv **out) {
    *out = nullptr;
    if (Hkv < 1 || Hkv > KVC_MAX_KV) return fail(KVC_ERR_UNSUPPORTED, "the CUDA backend holds 1 to %d KV heads, not %d", KVC_MAX_KV, Hkv);
    KVC_TRY(ensure_init());
    kvc_kv *kv = (kvc_kv *)calloc(1, sizeof *kv);
    if (!kv) return fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    kv->Hkv = Hkv;
    kv->d = d;
    kv->tables_bytes = (size_t)Hkv * (3 * sizeof(bf16 *) + 3 * sizeof(int32_t));
    kvc_status st = dalloc(&kv->tables, kv->tables_bytes, MEM_CACHE, "K/V tables");
    if (st != KVC_OK) {
        free(kv);
        return st;
    }
    kv->kd = (bf16 **)kv->tables;
    kv->vd = kv->kd + Hkv;
    kv->kxd = kv->vd + Hkv;
    kv->lend = (int32_t *)(kv->kxd + Hkv);
    kv->pastd = kv->lend + Hkv;
    kv->xrowsd = kv->pastd + Hkv;
    if (cudaMemsetAsync(kv->tables, 0, kv->tables_bytes, g.stream) != cudaSuccess) {
        st = cuda_fail(cudaGetLastError(), "K/V tables");
        kv_free(kv);
        return st;
    }
    if (fmt && kvt_is_typed(fmt) && (st = kvt_init(kv, fmt)) != KVC_OK) {
        kv_free(kv);
        return st;
    }
    *out = kv;
    return KVC_OK;
}

/* bf16 rows are stored as they are appended: nothing waits (a typed store's rows wait in f32: kv_typed.cu) */
kvc_status kv_commit(kvc_kv *kv) { return kv->typed ? kvt_commit(kv) : KVC_OK; }

void kv_free(kvc_kv *kv) {
    if (!kv) return;
    stream_wait();
    kv_pruned_forget(kv);
    kvt_free(kv);
    if (kv->arena) dfree(kv->arena, kv->bytes, MEM_CACHE);
    if (kv->tables) dfree(kv->tables, kv->tables_bytes, MEM_CACHE);
    free(kv->kidx);
    free(kv);
}

/* a head's block of a plain store (core/kv_layout.h with nothing pruned): K [cap, d] | V [cap, d] */
static kvc_kv_slices plain_slices(int32_t d, int64_t cap) { return kvc_kv_head_slices(sizeof(bf16), d, 0, cap, 0, KV_ALIGN); }

static size_t kv_arena_bytes(int32_t Hkv, int32_t d, const int64_t *cap) {
    size_t b = 0;
    for (int32_t h = 0; h < Hkv; h++) b += plain_slices(d, cap[h]).bytes;
    return b;
}

kvc_status kv_host_lens(const kvc_kv *kv, int64_t *len) {
    int32_t l32[KVC_MAX_KV];
    CU_TRY(d2h(l32, kv->lend, sizeof(int32_t) * kv->Hkv), "K/V lengths");
    CU_TRY(stream_wait(), "K/V lengths");
    for (int32_t h = 0; h < kv->Hkv; h++) len[h] = l32[h];
    return KVC_OK;
}

kvc_status kv_rows_check(kvc_kv_op op, const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const int64_t *keep,
                         int64_t held, int64_t cap) {
    char why[256];
    if (kvc_kv_rows_refused(op, h, kv->Hkv, row0, rows, keep, held, cap, why, sizeof why))
        return fail(KVC_ERR_INTERNAL, "%s", why);
    return KVC_OK;
}

size_t kv_bytes(const kvc_kv *kv) { return kv->typed ? kvt_bytes(kv) : kv->bytes; }

kvc_status kv_upload_tables(kvc_kv *kv, bf16 *const *kh, bf16 *const *vh, const int64_t *np, const int64_t *len) {
    int32_t len32[KVC_MAX_KV];
    bf16 *kshift[KVC_MAX_KV];
    for (int32_t h = 0; h < kv->Hkv; h++) {
        len32[h] = (int32_t)len[h];
        kshift[h] = kh[h] ? kh[h] - (np ? np[h] : 0) * kv->d : nullptr; /* row r >= np at kd[h] + r d */
    }
    CU_TRY(h2d(kv->kd, kshift, sizeof(bf16 *) * kv->Hkv), "K/V tables");
    CU_TRY(h2d(kv->vd, vh, sizeof(bf16 *) * kv->Hkv), "K/V tables");
    CU_TRY(h2d(kv->lend, len32, sizeof(int32_t) * kv->Hkv), "K/V lengths");
    CU_TRY(stream_wait(), "K/V tables"); /* len32 lives on this stack frame */
    return KVC_OK;
}
static kvc_status upload_tables(kvc_kv *kv, bf16 *const *kh, bf16 *const *vh, const int64_t *len) {
    return kv_upload_tables(kv, kh, vh, nullptr, len);
}

/* A new arena for cap[h] rows; on success the slices go to nk, nv. */
static kvc_status arena_new(const kvc_kv *kv, const int64_t *cap, void **arena, size_t *bytes, bf16 **nk, bf16 **nv) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        if (cap[h] < 0 || cap[h] >= 2147483647) return fail(KVC_ERR_ARG, "K/V store: %lld rows per head are out of range", (long long)cap[h]);
    *bytes = kv_arena_bytes(kv->Hkv, kv->d, cap);
    *arena = nullptr;
    if (*bytes) KVC_TRY(dalloc(arena, *bytes, MEM_CACHE, "KV cache"));
    size_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const kvc_kv_slices s = plain_slices(kv->d, cap[h]);
        nk[h] = *bytes ? (bf16 *)((char *)*arena + off + s.k) : nullptr;
        nv[h] = *bytes ? (bf16 *)((char *)*arena + off + s.v) : nullptr;
        off += s.bytes;
    }
    return KVC_OK;
}

/* The new arena replaces the old one once the copies into it are done and the device tables point at
 * it; on any failure the store keeps its old arena and tables (the core keeps its old lengths too). */
static kvc_status adopt(kvc_kv *kv, void *arena, size_t bytes, bf16 **nk, bf16 **nv, const int64_t *cap, const int64_t *len) {
    const cudaError_t e = stream_wait();
    kvc_status st = e == cudaSuccess ? upload_tables(kv, nk, nv, len) : cuda_fail(e, "K/V copy");
    if (st != KVC_OK) {
        /* best effort: point the device tables back at the old arena before the new one goes */
        h2d(kv->kd, kv->kh, sizeof(bf16 *) * kv->Hkv);
        h2d(kv->vd, kv->vh, sizeof(bf16 *) * kv->Hkv);
        stream_wait();
        if (arena) dfree(arena, bytes, MEM_CACHE);
        return st;
    }
    if (kv->arena) dfree(kv->arena, kv->bytes, MEM_CACHE);
    kv->arena = arena;
    kv->bytes = bytes;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        kv->kh[h] = nk[h];
        kv->vh[h] = nv[h];
        kv->kph[h] = nullptr;
        kv->np[h] = 0;
        kv->cap[h] = cap[h];
    }
    if (kv->dk) kv_layout_generation++; /* a pruned layout went */
    kv_pruned_forget(kv);
    free(kv->kidx);
    kv->kidx = nullptr;
    kv->invd = nullptr;
    kv->dk = 0;
    return KVC_OK;
}

/* Rows are checked against the lengths (core/kv_layout.h): the device's, read back, since a replayed graph
 * moves them without telling anyone here (they follow the core's: kv_set_lens). */
kvc_status kv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src) {
    const kvc_kv *from = src ? src : kv;
    int64_t held[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(from, held));
    for (int32_t h = 0; h < kv->Hkv; h++) KVC_TRY(kv_rows_check(KVC_KV_RESIZE, kv, h, 0, rows[h], nullptr, held[h], cap[h]));
    if (kv->typed || from->typed) {
        if (!kv->typed || !from->typed || kv->fmt.type != from->fmt.type || kv->fmt.group != from->fmt.group || kv->d != from->d)
            return fail(KVC_ERR_INTERNAL, "K/V resize: the source store has another type");
        return kvt_resize(kv, cap, rows, src);
    }
    if (from->dk) { /* the pruned prefix goes along */
        int64_t np[KVC_MAX_KV];
        for (int32_t h = 0; h < kv->Hkv; h++) np[h] = kvc_kv_resized_pruned(rows[h], from->np[h]);
        return kv_restage(kv, from, cap, nullptr, rows, np, from->dk, from->kidx);
    }
    void *arena;
    size_t bytes;
    bf16 *nk[KVC_MAX_KV], *nv[KVC_MAX_KV];
    KVC_TRY(arena_new(kv, cap, &arena, &bytes, nk, nv));
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const size_t n = sizeof(bf16) * (size_t)rows[h] * kv->d;
        if (n == 0) continue;
        if (cudaMemcpyAsync(nk[h], from->kh[h], n, cudaMemcpyDeviceToDevice, g.stream) != cudaSuccess ||
            cudaMemcpyAsync(nv[h], from->vh[h], n, cudaMemcpyDeviceToDevice, g.stream) != cudaSuccess) {
            const kvc_status st = cuda_fail(cudaGetLastError(), "K/V copy");
            stream_wait();
            if (arena) dfree(arena, bytes, MEM_CACHE);
            return st;
        }
    }
    return adopt(kv, arena, bytes, nk, nv, cap, rows);
}

kvc_status kv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap) {
    int64_t total = 0, held[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(kv, held));
    for (int32_t h = 0; h < kv->Hkv; h++) {
        KVC_TRY(kv_rows_check(KVC_KV_GATHER, kv, h, 0, n_keep[h], keep[h], held[h], cap[h]));
        total += n_keep[h];
    }
    if (kv->typed) return kvt_gather(kv, keep, n_keep, cap);
    if (kv->dk) { /* kept rows of the pruned prefix stay pruned */
        int64_t np[KVC_MAX_KV];
        for (int32_t h = 0; h < kv->Hkv; h++) np[h] = kvc_kv_gathered_pruned(keep[h], n_keep[h], kv->np[h]);
        return kv_restage(kv, kv, cap, keep, n_keep, np, kv->dk, kv->kidx);
    }
    int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    if (!rows) return fail(KVC_ERR_NOMEM, "out of memory: compaction rows");
    GatherInfo gi;
    memset(&gi, 0, sizeof gi);
    int64_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        gi.off[h] = off;
        for (int64_t i = 0; i < n_keep[h]; i++) rows[off++] = (int32_t)keep[h][i];
    }
    gi.off[kv->Hkv] = off;
    void *arena = nullptr;
    size_t bytes = 0;
    bf16 *nk[KVC_MAX_KV], *nv[KVC_MAX_KV];
    kvc_status st = scratch(g_rows_d, sizeof(int32_t) * (size_t)(total > 0 ? total : 1), "compaction rows");
    if (st == KVC_OK && total > 0 &&
        h2d(g_rows_d.p, rows, sizeof(int32_t) * total) != cudaSuccess)
        st = cuda_fail(cudaGetLastError(), "compaction rows");
    if (st == KVC_OK) st = arena_new(kv, cap, &arena, &bytes, nk, nv);
    if (st == KVC_OK) {
        for (int32_t h = 0; h < kv->Hkv; h++) {
            gi.ok[h] = kv->kh[h];
            gi.ov[h] = kv->vh[h];
            gi.nk[h] = nk[h];
            gi.nv[h] = nv[h];
        }
        if (total > 0) st = gather_rows(gi, kv->Hkv, kv->d, g_rows_d.as<int32_t>());
        if (st == KVC_OK) st = adopt(kv, arena, bytes, nk, nv, cap, n_keep);
        else if (arena) {
            stream_wait();
            dfree(arena, bytes, MEM_CACHE);
        }
    }
    stream_wait(); /* rows (host) was read by the copy */
    free(rows);
    return st;
}

kvc_status kv_set_lens(kvc_kv *kv, const int64_t *len) {
    int into_pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        if (len[h] < 0 || len[h] > kv->cap[h])
            return fail(KVC_ERR_INTERNAL, "K/V lengths: head %d gets %lld rows of %lld", h, (long long)len[h],
                        (long long)kv->cap[h]);
        into_pruned |= len[h] < kv->np[h];
    }
    if (kv->typed) return kvt_set_lens(kv, len);
    if (into_pruned) { /* the pruned prefix shrinks (later rows are full again): a new arena */
        int64_t np[KVC_MAX_KV], cap[KVC_MAX_KV];
        for (int32_t h = 0; h < kv->Hkv; h++) {
            np[h] = len[h] < kv->np[h] ? len[h] : kv->np[h];
            cap[h] = kv->cap[h];
        }
        return kv_restage(kv, kv, cap, nullptr, len, np, kv->dk, kv->kidx);
    }
    if (kv->dk) KVC_TRY(kv_pruned_stale(kv)); /* a truncation: rows appended later reuse expanded slots */
    return kv_upload_tables(kv, kv->kh, kv->vh, kv->np, len);
}

kvc_status kv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v) {
    KVC_TRY(kv_rows_check(KVC_KV_WRITE, kv, h, row0, rows, nullptr, 0, h >= 0 && h < kv->Hkv ? kv->cap[h] : 0));
    if (rows == 0) return KVC_OK;
    if (kv->typed) {
        int64_t idx_h[1] = {0}, *idx[KVC_MAX_KV] = {nullptr}, n[KVC_MAX_KV] = {0};
        int64_t *ix = (int64_t *)malloc(sizeof(int64_t) * (size_t)rows);
        if (!ix) return fail(KVC_ERR_NOMEM, "out of memory: K/V write");
        for (int64_t i = 0; i < rows; i++) ix[i] = row0 + i;
        for (int32_t j = 0; j < kv->Hkv; j++) idx[j] = idx_h;
        idx[h] = ix;
        n[h] = rows;
        const kvc_status st = kvt_write_rows(kv, idx, n, k, v, 0);
        free(ix);
        return st;
    }
    if (kv->dk) return kv_write_pruned(kv, h, row0, rows, k, v);
    const int64_t n = rows * kv->d;
    KVC_TRY(scratch(g_stage, sizeof(float) * n, "K/V write staging"));
    for (int pass = 0; pass < 2; pass++) {
        const float *src = pass ? v : k;
        if (!src) continue;
        CU_TRY(h2d(g_stage.p, src, sizeof(float) * n), "K/V write");
        KVC_TRY(f32_to_bf16(g_stage.as<float>(), (pass ? kv->vh[h] : kv->kh[h]) + row0 * kv->d, n));
        CU_TRY(stream_wait(), "K/V write");
    }
    return KVC_OK;
}

kvc_status kv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v) {
    int64_t held[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(kv, held));
    KVC_TRY(kv_rows_check(KVC_KV_READ, kv, h, row0, rows, nullptr, h >= 0 && h < kv->Hkv ? held[h] : 0, 0));
    if (rows == 0) return KVC_OK;
    if (kv->typed) { /* one head of the batched read */
        int64_t r0[KVC_MAX_KV] = {0}, n[KVC_MAX_KV] = {0};
        r0[h] = row0;
        n[h] = rows;
        return kvt_read_heads(kv, r0, n, k, v);
    }
    if (kv->dk) return kv_read_pruned(kv, h, row0, rows, k, v);
    const int64_t n = rows * kv->d;
    KVC_TRY(scratch(g_stage, sizeof(float) * n, "K/V read staging"));
    for (int pass = 0; pass < 2; pass++) {
        float *dst = pass ? v : k;
        if (!dst) continue;
        KVC_TRY(bf16_to_f32((pass ? kv->vh[h] : kv->kh[h]) + row0 * kv->d, g_stage.as<float>(), n));
        CU_TRY(d2h(dst, g_stage.p, sizeof(float) * n), "K/V read");
        CU_TRY(stream_wait(), "K/V read");
    }
    return KVC_OK;
}

/* Every head's rows converted into one f32 staging block on the device (K of every head, then V), one copy into
 * pinned memory, one wait; then spread into the caller's arrays. A store with pruned keys reads head by head. */
kvc_status kv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t held[KVC_MAX_KV], total = 0;
    KVC_TRY(kv_host_lens(kv, held));
    for (int32_t h = 0; h < Hkv; h++) {
        KVC_TRY(kv_rows_check(KVC_KV_READ, kv, h, row0 ? row0[h] : 0, rows[h], nullptr, held[h], 0));
        total += rows[h];
    }
    if (total == 0 || (!k && !v)) return KVC_OK;
    if (kv->typed) return kvt_read_heads(kv, row0, rows, k, v);
    if (kv->dk) {
        int64_t off = 0;
        for (int32_t h = 0; h < Hkv; off += rows[h] * d, h++)
            if (rows[h] > 0) KVC_TRY(kv_read_pruned(kv, h, row0 ? row0[h] : 0, rows[h], k ? k + off : nullptr, v ? v + off : nullptr));
        return KVC_OK;
    }
    const int64_t n = total * d, parts = (k != nullptr) + (v != nullptr);
    KVC_TRY(scratch(g_stage, sizeof(float) * (size_t)(n * parts), "K/V read staging"));
    KVC_TRY(g_pinned.need(sizeof(float) * (size_t)(n * parts), "K/V read (pinned)"));
    int64_t off = 0;
    for (int32_t h = 0; h < Hkv; off += rows[h] * d, h++) {
        if (rows[h] == 0) continue;
        const int64_t r0 = (row0 ? row0[h] : 0) * d;
        if (k) KVC_TRY(bf16_to_f32(kv->kh[h] + r0, g_stage.as<float>() + off, rows[h] * d));
        if (v) KVC_TRY(bf16_to_f32(kv->vh[h] + r0, g_stage.as<float>() + (k ? n : 0) + off, rows[h] * d));
    }
    CU_TRY(d2h(g_pinned.p, g_stage.p, sizeof(float) * (size_t)(n * parts)), "K/V read");
    CU_TRY(stream_wait(), "K/V read");
    if (k) memcpy(k, g_pinned.p, sizeof(float) * (size_t)n);
    if (v) memcpy(v, g_pinned.as<float>() + (k ? n : 0), sizeof(float) * (size_t)n);
    return KVC_OK;
}

/* Scatter of rows written back: one block per row, its head found from the prefix sums of the counts. */
struct ScatterInfo {
    bf16 *k[KVC_MAX_KV], *v[KVC_MAX_KV];
    int64_t off[KVC_MAX_KV + 1];
};

__global__ void scatter_rows_kernel(const ScatterInfo si, int32_t Hkv, int32_t d, const int32_t *__restrict__ idx,
                                    const float *__restrict__ kin, const float *__restrict__ vin) {
    const int64_t i = blockIdx.x;
    int32_t h = 0;
    while (h + 1 < Hkv && si.off[h + 1] <= i) h++;
    const int64_t r = idx[i];
    for (int32_t c = threadIdx.x; c < d; c += blockDim.x) {
        if (kin) si.k[h][r * d + c] = __float2bfloat16(kin[i * d + c]);
        if (vin) si.v[h][r * d + c] = __float2bfloat16(vin[i * d + c]);
    }
}

/* The rows and their indices packed into pinned memory, one copy, one scatter, one wait (the pinned block is
 * reused by the next call). Keys of a store with pruned rows go head by head (kv_write keeps their channels). */
kvc_status kv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t total = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        for (int64_t i = 0; i < n[h]; i++) KVC_TRY(kv_rows_check(KVC_KV_WRITE, kv, h, idx[h][i], 1, nullptr, 0, kv->cap[h]));
        total += n[h];
    }
    if (total == 0 || (!k && !v)) return KVC_OK;
    if (kv->typed) return kvt_write_rows(kv, idx, n, k, v, 1);
    if (kv->dk && k) {
        int64_t off = 0;
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t i = 0; i < n[h]; i++, off += d)
                KVC_TRY(kv_write(kv, h, idx[h][i], 1, k + off, v ? v + off : nullptr));
        return KVC_OK;
    }
    if (total >= 2147483647) return fail(KVC_ERR_ARG, "K/V write: %lld rows in one call", (long long)total);
    const int64_t vals = total * d, parts = (k != nullptr) + (v != nullptr);
    const size_t bytes = sizeof(int32_t) * (size_t)total + sizeof(float) * (size_t)(vals * parts);
    KVC_TRY(g_pinned.need(bytes, "K/V write (pinned)"));
    KVC_TRY(scratch(g_stage, bytes, "K/V write staging"));
    /* every entry that copies from the pinned block waits for the copy before it returns: it is free here */
    int32_t *ix = g_pinned.as<int32_t>();
    float *vals_h = (float *)(ix + total);
    ScatterInfo si;
    memset(&si, 0, sizeof si);
    int64_t off = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        si.k[h] = kv->kh[h];
        si.v[h] = kv->vh[h];
        si.off[h] = off;
        for (int64_t i = 0; i < n[h]; i++) ix[off + i] = (int32_t)idx[h][i];
        off += n[h];
    }
    si.off[Hkv] = off;
    if (k) memcpy(vals_h, k, sizeof(float) * (size_t)vals);
    if (v) memcpy(vals_h + (k ? vals : 0), v, sizeof(float) * (size_t)vals);
    CU_TRY(h2d(g_stage.p, g_pinned.p, bytes), "K/V write");
    const int32_t *ixd = g_stage.as<int32_t>();
    const float *kd = (const float *)(ixd + total);
    scatter_rows_kernel<<<(unsigned)total, d < 128 ? d : 128, 0, g.stream>>>(si, Hkv, d, ixd, k ? kd : nullptr,
                                                                          v ? kd + (k ? vals : 0) : nullptr);
    LAUNCH_TRY("K/V write");
    CU_TRY(stream_wait(), "K/V write");
    return KVC_OK;
}

/* Rows lent in place (core/backend.h, kv_rows): device pointers into the arena, bf16; a pruned store lends none. */
int32_t kv_rows(const kvc_kv *kv, int32_t h, const void **k, const void **v) {
    *k = *v = nullptr;
    if (h < 0 || h >= kv->Hkv || kv->dk) return -1;
    *k = kv->kh[h];
    *v = kv->vh[h];
    return KVC_BF16;
}

/* The old arena, handed to a holder of rows lent from it. */
struct KeptArena {
    void *arena;
    size_t bytes;
};

/* The store continues in a copy of its rows (the device tables, at fixed addresses, point at the copy, so graphs
 * stay valid); the old arena goes to the holder: with kv->arena cleared, adopt frees nothing. */
kvc_status kv_keep_rows(kvc_kv *kv, void **kept) {
    *kept = nullptr;
    if (kv->dk) return fail(KVC_ERR_INTERNAL, "K/V keep: a store with pruned rows lends none");
    int64_t len[KVC_MAX_KV], cap[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(kv, len));
    memcpy(cap, kv->cap, sizeof(int64_t) * kv->Hkv);
    KeptArena *o = (KeptArena *)malloc(sizeof *o);
    if (!o) return fail(KVC_ERR_NOMEM, "out of memory: kept K/V rows");
    o->arena = kv->arena;
    o->bytes = kv->bytes;
    kv->arena = nullptr;
    const kvc_status st = kv_resize(kv, cap, len, nullptr);
    if (st != KVC_OK) {
        kv->arena = o->arena;
        kv->bytes = o->bytes;
        free(o);
        return st;
    }
    *kept = o;
    return KVC_OK;
}

/* cudaFree and the counters' mutex: any thread (graphs are captured thread-locally) */
void kv_kept_free(void *kept) {
    KeptArena *o = (KeptArena *)kept;
    if (!o) return;
    dfree(o->arena, o->bytes, MEM_CACHE);
    free(o);
}

/* rows at the device lengths, then lengths += n on the device (graph-safe) */
kvc_status kv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n) {
    if (src.buf->dtype != KVC_BF16) return fail(KVC_ERR_INTERNAL, "K/V append: the rows must be bf16");
    if (kv->typed) return kvt_append(kv, src, kcol, vcol, n);
    KVC_TRY(append_kv(at<bf16>(src), src.ld, kcol, vcol, n, kv->Hkv, kv->d, kv->kd, kv->vd, kv->lend));
    return add_lens(kv->lend, kv->Hkv, (int32_t)n);
}

} // namespace kvc
