/* ThinK-pruned K rows in the CUDA K/V store (core/backend.h, "Key-channel pruning"; the layout is in
 * common.cuh): per head one arena slice of np rows x dk kept channels, then the full rows, then V. Layout
 * changes of a pruned store (prune, growth, compaction, truncation into the prefix) go through the host
 * as f32 rows (bf16 -> f32 -> bf16 is exact); they happen once per compressed layer or on a geometric
 * growth. The kernels read pruned rows expanded to d channels (zeros in the dropped ones) into a scratch
 * of the layer's rows (kv_keys_full): the cache keeps the freed bytes, one layer's keys are expanded at a
 * time. The scratch remembers on the device whose rows it holds (g_owner, the store's xrowsd): expanding the
 * same store again (a model with one pruned layer; prefill chunks of one layer) converts only the rows appended
 * since, and a store's layout change, truncation or key write starts it again from row 0. With several pruned
 * layers each decode step expands every row of each (the scratch is shared so the freed bytes stay free).
 * Compile-only in this project's CI (no GPU): the CPU backend is the reference it follows. */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

namespace kvc {

uint64_t kv_layout_generation = 0;
static Buf g_stage_p, g_kexp; /* row conversions, expanded keys (one layer at a time) */
static kvc_kv *g_pruned;      /* the stores with pruned rows: their expanded-key tables point into g_kexp */
static Buf g_owner;           /* device uint64: the store (its address) whose rows g_kexp holds expanded; 0: none */

/* the scratch holds nobody's rows (it moved, or a store's rows changed) */
static kvc_status owner_clear(void) {
    KVC_TRY(scratch(g_owner, sizeof(uint64_t), "pruned keys owner"));
    CU_TRY(cudaMemsetAsync(g_owner.p, 0, sizeof(uint64_t), g.stream), "pruned keys owner");
    return KVC_OK;
}

kvc_status kv_pruned_stale(kvc_kv *kv) {
    CU_TRY(cudaMemsetAsync(kv->xrowsd, 0, sizeof(int32_t) * kv->Hkv, g.stream), "pruned keys");
    return KVC_OK;
}

/* a head's block: Kp [np, dk] | K [cap - np, d] | V [cap, d] (core/kv_layout.h) */
static kvc_kv_slices slices_p(int32_t d, int32_t dk, int64_t cap, int64_t np) {
    return kvc_kv_head_slices(sizeof(bf16), d, dk, cap, np, KV_ALIGN);
}

/* n f32 values from the host into bf16 device memory, and back */
static kvc_status put_f32(const float *src, bf16 *dst, int64_t n) {
    if (n <= 0) return KVC_OK;
    KVC_TRY(scratch(g_stage_p, sizeof(float) * (size_t)n, "K/V staging"));
    CU_TRY(h2d(g_stage_p.p, src, sizeof(float) * (size_t)n), "K/V write");
    KVC_TRY(f32_to_bf16(g_stage_p.as<float>(), dst, n));
    CU_TRY(stream_wait(), "K/V write");
    return KVC_OK;
}
static kvc_status get_f32(const bf16 *src, float *dst, int64_t n) {
    if (n <= 0) return KVC_OK;
    KVC_TRY(scratch(g_stage_p, sizeof(float) * (size_t)n, "K/V staging"));
    KVC_TRY(bf16_to_f32(src, g_stage_p.as<float>(), n));
    CU_TRY(d2h(dst, g_stage_p.p, sizeof(float) * (size_t)n), "K/V read");
    CU_TRY(stream_wait(), "K/V read");
    return KVC_OK;
}

/* rows [row0, row0 + rows) of head h: pruned ones expanded (zeros in the dropped channels) */
kvc_status kv_read_pruned(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v) {
    const int32_t d = kv->d, dk = kv->dk;
    if (v) KVC_TRY(get_f32(kv->vh[h] + row0 * d, v, rows * d));
    if (!k) return KVC_OK;
    const int64_t np = kv->np[h], pe = row0 + rows < np ? row0 + rows : np; /* pruned rows [row0, pe) */
    if (pe > row0) {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)(pe - row0) * dk);
        if (!tmp) return fail(KVC_ERR_NOMEM, "out of memory: K/V read");
        const kvc_status st = get_f32(kv->kph[h] + row0 * dk, tmp, (pe - row0) * dk);
        if (st == KVC_OK) {
            const int32_t *ix = kv->kidx + (size_t)h * dk;
            memset(k, 0, sizeof(float) * (size_t)(pe - row0) * d);
            for (int64_t r = 0; r < pe - row0; r++)
                for (int32_t j = 0; j < dk; j++) k[r * d + ix[j]] = tmp[r * dk + j];
        }
        free(tmp);
        KVC_TRY(st);
    }
    const int64_t f0 = pe > row0 ? pe : row0; /* full rows [f0, row0 + rows) */
    return get_f32(kv->kh[h] + kvc_kv_full_row(f0, np) * d, k + (f0 - row0) * d, (row0 + rows - f0) * d);
}

/* the same rows written: a pruned row keeps its kept channels only */
kvc_status kv_write_pruned(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v) {
    const int32_t d = kv->d, dk = kv->dk;
    if (k) KVC_TRY(kv_pruned_stale(kv)); /* expanded copies of these keys are stale */
    if (v) KVC_TRY(put_f32(v, kv->vh[h] + row0 * d, rows * d));
    if (!k) return KVC_OK;
    const int64_t np = kv->np[h], pe = row0 + rows < np ? row0 + rows : np;
    if (pe > row0) {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)(pe - row0) * dk);
        if (!tmp) return fail(KVC_ERR_NOMEM, "out of memory: K/V write");
        const int32_t *ix = kv->kidx + (size_t)h * dk;
        for (int64_t r = 0; r < pe - row0; r++)
            for (int32_t j = 0; j < dk; j++) tmp[r * dk + j] = k[r * d + ix[j]];
        const kvc_status st = put_f32(tmp, kv->kph[h] + row0 * dk, (pe - row0) * dk);
        free(tmp);
        KVC_TRY(st);
    }
    const int64_t f0 = pe > row0 ? pe : row0;
    return put_f32(k + (f0 - row0) * d, kv->kh[h] + kvc_kv_full_row(f0, np) * d, (row0 + rows - f0) * d);
}

/* ---- the expansion scratch ------------------------------------------------------------------------
 * Sized and pointed at when a layout changes (restage), never during a graph capture: a capture's
 * kv_keys_full then finds the scratch big enough and the store's table current. A store's heads sit at
 * the scratch's start, head h after heads < h at their capacities. */

/* where the expanded heads of a store of Hkv heads of d channels with capacities cap go in the scratch as
 * it is; the bytes they need */
static size_t kexp_heads(int32_t Hkv, int32_t d, const int64_t *cap, bf16 **outs) {
    size_t off = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        outs[h] = g_kexp.as<bf16>() + off;
        off += (size_t)cap[h] * d;
    }
    return sizeof(bf16) * (off ? off : 1);
}

/* the store's device table of expanded heads points at them for capacities cap (uploaded when it changed;
 * the host copy changes once the upload is done) */
static kvc_status kexp_point(kvc_kv *kv, const int64_t *cap) {
    bf16 *outs[KVC_MAX_KV];
    kexp_heads(kv->Hkv, kv->d, cap, outs);
    if (!memcmp(outs, kv->kxh, sizeof(bf16 *) * kv->Hkv)) return KVC_OK;
    CU_TRY(h2d(kv->kxd, outs, sizeof(bf16 *) * kv->Hkv), "pruned keys table");
    CU_TRY(stream_wait(), "pruned keys table"); /* outs lives on this stack frame */
    memcpy(kv->kxh, outs, sizeof(bf16 *) * kv->Hkv);
    return KVC_OK;
}

/* The scratch holds a store kv with capacities cap: when it grows, every listed store's table moves with
 * it (graphs captured before read the old one, hence the generation). */
static kvc_status kexp_reserve(const kvc_kv *kv, const int64_t *cap) {
    bf16 *outs[KVC_MAX_KV];
    if (kexp_heads(kv->Hkv, kv->d, cap, outs) <= g_kexp.bytes) return KVC_OK;
    KVC_TRY(scratch(g_kexp, kexp_heads(kv->Hkv, kv->d, cap, outs), "pruned keys expanded"));
    KVC_TRY(owner_clear()); /* a new scratch holds nothing */
    kv_layout_generation++;
    for (kvc_kv *o = g_pruned; o; o = o->pruned_next) KVC_TRY(kexp_point(o, o->cap));
    return KVC_OK;
}

static void kexp_list(kvc_kv *kv) {
    if (kv->pruned_listed) return;
    kv->pruned_next = g_pruned;
    g_pruned = kv;
    kv->pruned_listed = 1;
}

void kv_pruned_forget(kvc_kv *kv) {
    if (!kv->pruned_listed) return;
    for (kvc_kv **p = &g_pruned; *p; p = &(*p)->pruned_next)
        if (*p == kv) {
            *p = kv->pruned_next;
            break;
        }
    kv->pruned_next = nullptr;
    kv->pruned_listed = 0;
}

kvc_status kv_restage(kvc_kv *kv, const kvc_kv *from, const int64_t *cap, const int64_t *const *keep, const int64_t *n,
                      const int64_t *np_new, int32_t dk, const int32_t *kidx) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t np[KVC_MAX_KV], any = 0;
    for (int32_t h = 0; h < Hkv; h++) any += np[h] = dk ? np_new[h] : 0;
    if (!any) dk = 0; /* nothing pruned any more: the plain layout */
    /* the arena: per head Kp [np, dk] | K [cap - np, d] | V [cap, d], then the channel map [Hkv, d] */
    size_t bytes = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        if (cap[h] < 0 || cap[h] >= 2147483647 || np[h] > cap[h] || n[h] > cap[h])
            return fail(KVC_ERR_INTERNAL, "K/V restage: head %d holds %lld rows (%lld pruned) in %lld", h,
                        (long long)n[h], (long long)np[h], (long long)cap[h]);
        bytes += slices_p(d, dk, cap[h], np[h]).bytes;
    }
    const size_t map_off = bytes;
    if (dk) bytes += sizeof(int32_t) * (size_t)Hkv * d;
    if (dk && !g_owner.p) KVC_TRY(owner_clear()); /* here, never in a capture's kv_keys_full */
    if (dk) KVC_TRY(kexp_reserve(kv, cap));
    void *arena = nullptr;
    if (bytes) KVC_TRY(dalloc(&arena, bytes, MEM_CACHE, "KV cache"));
    bf16 *nkp[KVC_MAX_KV], *nk[KVC_MAX_KV], *nv[KVC_MAX_KV];
    size_t off = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        const kvc_kv_slices sl = slices_p(d, dk, cap[h], np[h]);
        nkp[h] = (bf16 *)((char *)arena + off + sl.kp);
        nk[h] = (bf16 *)((char *)arena + off + sl.k);
        nv[h] = (bf16 *)((char *)arena + off + sl.v);
        off += sl.bytes;
    }
    int32_t *ixc = dk ? (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * dk) : nullptr;
    int32_t *inv = dk ? (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * d) : nullptr;
    int64_t maxn = 1; /* source rows read per head */
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t m = keep ? (n[h] > 0 ? keep[h][n[h] - 1] + 1 : 0) : n[h];
        maxn = m > maxn ? m : maxn;
    }
    float *K = (float *)malloc(sizeof(float) * (size_t)maxn * d), *V = (float *)malloc(sizeof(float) * (size_t)maxn * d);
    float *Kp = (float *)malloc(sizeof(float) * (size_t)maxn * (dk ? dk : 1));
    kvc_status st = (!K || !V || !Kp || (dk && (!ixc || !inv))) ? fail(KVC_ERR_NOMEM, "out of memory: K/V restage") : KVC_OK;
    if (st == KVC_OK && dk) {
        memcpy(ixc, kidx, sizeof(int32_t) * (size_t)Hkv * dk);
        for (int32_t h = 0; h < Hkv; h++) {
            for (int32_t c = 0; c < d; c++) inv[(size_t)h * d + c] = -1;
            for (int32_t j = 0; j < dk; j++) inv[(size_t)h * d + kidx[(size_t)h * dk + j]] = j;
        }
        if (h2d((char *)arena + map_off, inv, sizeof(int32_t) * (size_t)Hkv * d) != cudaSuccess)
            st = cuda_fail(cudaGetLastError(), "K/V channel map");
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        /* the source rows [0, m) as f32 in one read (pruned rows expanded), then the kept ones packed in
         * place (keep[h][i] >= i, increasing: no source is overwritten before it is read) */
        const int64_t m = keep ? (n[h] > 0 ? keep[h][n[h] - 1] + 1 : 0) : n[h];
        if (m > 0 && from->dk) {
            st = kv_read_pruned(from, h, 0, m, K, V);
        } else if (m > 0) {
            st = get_f32(from->kh[h], K, m * d);
            if (st == KVC_OK) st = get_f32(from->vh[h], V, m * d);
        }
        for (int64_t i = 0; keep && st == KVC_OK && i < n[h]; i++)
            if (keep[h][i] != i) {
                memcpy(K + i * d, K + keep[h][i] * d, sizeof(float) * (size_t)d);
                memcpy(V + i * d, V + keep[h][i] * d, sizeof(float) * (size_t)d);
            }
        if (st != KVC_OK) break;
        for (int64_t i = 0; i < np[h]; i++)
            for (int32_t j = 0; j < dk; j++) Kp[i * dk + j] = K[i * d + kidx[(size_t)h * dk + j]];
        st = put_f32(Kp, nkp[h], np[h] * dk);
        if (st == KVC_OK) st = put_f32(K + np[h] * d, nk[h], (n[h] - np[h]) * d);
        if (st == KVC_OK) st = put_f32(V, nv[h], n[h] * d);
    }
    if (st == KVC_OK && dk) st = kexp_point(kv, cap);
    if (st == KVC_OK) st = kv_pruned_stale(kv); /* a new layout: nothing of it is expanded yet */
    if (st == KVC_OK) st = kv_upload_tables(kv, nk, nv, np, n);
    if (st != KVC_OK) {
        stream_wait();
        if (arena) dfree(arena, bytes, MEM_CACHE);
        free(ixc);
    } else {
        if (kv->arena) dfree(kv->arena, kv->bytes, MEM_CACHE);
        kv->arena = arena;
        kv->bytes = bytes;
        for (int32_t h = 0; h < Hkv; h++) {
            kv->kh[h] = nk[h];
            kv->vh[h] = nv[h];
            kv->kph[h] = np[h] ? nkp[h] : nullptr;
            kv->np[h] = np[h];
            kv->cap[h] = cap[h];
        }
        free(kv->kidx);
        kv->kidx = ixc;
        kv->dk = dk;
        kv->invd = dk ? (int32_t *)((char *)arena + map_off) : nullptr;
        kv_layout_generation++;
        if (dk) kexp_list(kv);
        else kv_pruned_forget(kv);
    }
    free(inv);
    free(K);
    free(V);
    free(Kp);
    return st;
}

kvc_status kv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    if (dk < 1 || dk > kv->d) return fail(KVC_ERR_INTERNAL, "K/V prune: %d kept channels of %d", dk, kv->d);
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int32_t j = 0; j < dk; j++) {
            const int32_t c = kidx[(size_t)h * dk + j];
            if (c < 0 || c >= kv->d || (j > 0 && c <= kidx[(size_t)h * dk + j - 1]))
                return fail(KVC_ERR_INTERNAL, "K/V prune: head %d channels are not increasing inside [0, %d)", h, kv->d);
        }
    if (kv->typed) return kvt_prune_keys(kv, dk, kidx);
    int64_t len[KVC_MAX_KV], cap[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(kv, len));
    for (int32_t h = 0; h < kv->Hkv; h++) cap[h] = kv->cap[h];
    return kv_restage(kv, kv, cap, nullptr, len, len, dk, kidx); /* every row held becomes pruned */
}

/* Expansion: blocks stride over the rows of head blockIdx.y not yet expanded ([xrows, len) when the scratch holds
 * this store's rows, else [0, len)); rows at or past the device length are left alone. */
struct ExpandInfo {
    const bf16 *kp[KVC_MAX_KV], *kf[KVC_MAX_KV];
    bf16 *out[KVC_MAX_KV];
    int64_t np[KVC_MAX_KV];
};

__global__ void expand_keys_kernel(const ExpandInfo ei, const int32_t *__restrict__ len, const int32_t *__restrict__ inv,
                                   int32_t d, int32_t dk, const uint64_t *__restrict__ owner, uint64_t self,
                                   const int32_t *__restrict__ xrows) {
    const int32_t h = blockIdx.y;
    const int64_t np = ei.np[h];
    const int64_t from = *owner == self && xrows[h] <= len[h] ? xrows[h] : 0;
    for (int64_t r = from + blockIdx.x; r < len[h]; r += gridDim.x) {
        bf16 *o = ei.out[h] + r * d;
        for (int32_t c = threadIdx.x; c < d; c += blockDim.x) {
            if (r >= np) {
                o[c] = ei.kf[h][(r - np) * d + c];
            } else {
                const int32_t j = inv[(size_t)h * d + c];
                o[c] = j >= 0 ? ei.kp[h][r * dk + j] : __float2bfloat16(0.f);
            }
        }
    }
}

/* after the expansion (stream order): the scratch holds this store's rows up to its lengths */
__global__ void expand_done_kernel(uint64_t *owner, uint64_t self, int32_t *xrows, const int32_t *len, int32_t Hkv) {
    if (threadIdx.x == 0) *owner = self;
    for (int32_t h = threadIdx.x; h < Hkv; h += blockDim.x) xrows[h] = len[h];
}

kvc_status kv_keys_full(const kvc_kv *kvc, const bf16 **heads, bf16 ***table) {
    kvc_kv *kv = (kvc_kv *)kvc; /* only its expansion table changes */
    const int32_t Hkv = kv->Hkv, d = kv->d;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CU_TRY(cudaStreamIsCapturing(g.stream, &cs), "pruned keys");
    int64_t maxcap = 1;
    for (int32_t h = 0; h < Hkv; h++) maxcap = kv->cap[h] > maxcap ? kv->cap[h] : maxcap;
    bf16 *outs[KVC_MAX_KV];
    if (kexp_heads(Hkv, d, kv->cap, outs) > g_kexp.bytes) {
        /* a safety net (restage sizes the scratch and points the table): growing moves the scratch, illegal
         * while a graph is being captured, and graphs captured before read the old one */
        if (cs != cudaStreamCaptureStatusNone)
            return fail(KVC_ERR_UNSUPPORTED, "CUDA pruned-key scratch must grow during a graph capture");
        KVC_TRY(kexp_reserve(kv, kv->cap));
        kexp_heads(Hkv, d, kv->cap, outs);
    }
    ExpandInfo ei;
    memset(&ei, 0, sizeof ei);
    int changed = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        heads[h] = outs[h];
        changed |= outs[h] != kv->kxh[h];
        ei.kp[h] = kv->kph[h];
        ei.kf[h] = kv->kh[h];
        ei.out[h] = outs[h];
        ei.np[h] = kv->np[h];
    }
    if (changed) { /* the store's table of expanded heads (fixed address) follows the scratch */
        if (cs != cudaStreamCaptureStatusNone)
            return fail(KVC_ERR_UNSUPPORTED, "CUDA pruned-key table changed during a graph capture");
        memcpy(kv->kxh, outs, sizeof(bf16 *) * Hkv);
        CU_TRY(h2d(kv->kxd, kv->kxh, sizeof(bf16 *) * Hkv), "pruned keys table");
    }
    if (!g_owner.p) { /* sized once, outside a capture (restage clears it first) */
        if (cs != cudaStreamCaptureStatusNone)
            return fail(KVC_ERR_UNSUPPORTED, "CUDA pruned-key owner must be allocated during a graph capture");
        KVC_TRY(owner_clear());
    }
    /* enough blocks for a prefill's rows, few enough that a decode step's one new row costs little */
    const unsigned blocks = (unsigned)(maxcap < 1024 ? maxcap : 1024);
    const uint64_t self = (uint64_t)(uintptr_t)kv;
    dim3 grid(blocks, (unsigned)Hkv);
    expand_keys_kernel<<<grid, d < 128 ? d : 128, 0, g.stream>>>(ei, kv->lend, kv->invd, d, kv->dk, g_owner.as<uint64_t>(),
                                                                 self, kv->xrowsd);
    LAUNCH_TRY("pruned keys expansion");
    expand_done_kernel<<<1, 64, 0, g.stream>>>(g_owner.as<uint64_t>(), self, kv->xrowsd, kv->lend, Hkv);
    LAUNCH_TRY("pruned keys expansion");
    *table = kv->kxd;
    return KVC_OK;
}

} // namespace kvc
