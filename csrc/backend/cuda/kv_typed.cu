/* Typed K/V stores of the CUDA backend (issue 27): a layer's rows in f32, f16, q8_0 or KIVI 4/2-bit, with the
 * host store's semantics (backend/cpu/kv_store.c, the reference the emulated device runs) and core/kv_type.h's
 * formats (the one home: every kernel here encodes and decodes through it).
 *
 * One arena per layer; per head [Kp: np narrow rows][K: full rows, or KIVI key blocks][V rows], 256-byte aligned
 * slices (KIVI keeps pruned rows at full width with zeros, as on the host). Rows [0, nq) are in the type; rows
 * [nq, len) wait as f32 staging rows: those a layer appended until its attention has read them (kv_commit), and
 * KIVI's residual until `residual` rows wait (then every whole block of them goes into the type). The device
 * table (KvTab: arena and staging pointers, np, nq) sits at a fixed address and the commit kernels read the
 * lengths and nq from the device, so a decode graph replays append, attention and commit; the staging rows grow
 * only eagerly (a graph's warm-up step sizes them: rows stored alone need 1 a step, KIVI at most
 * max(residual, group) wait between steps).
 * Layout changes are kernels: rows stored alone are committed first and copied as stored where their key layout
 * stays (else decoded and encoded again); KIVI copies the whole key blocks of a kept prefix and stages every other
 * kept row in f32, then applies kv_commit's rule, as transformers' QuantizedCache quantises again what a press
 * keeps. Writes into KIVI rows below nq first turn their blocks back into staging rows.
 * Compile-only in this project's CI (no GPU): the emulated device runs the host store these kernels follow. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.cuh"

namespace kvc {

static Buf g_idx_t, g_rows_t, g_exp_t; /* row lists and channel maps; f32 rows of reads and writes; the scorers' rows */
static Pinned g_pin_t;                 /* the host side of the batched reads and writes */

#define KVT_THREADS 256
#define KVT_MAX_BLOCKS 4096

int kvt_is_typed(const kvc_kv_format *f) { return f->type != KVC_KV_NATIVE && f->type != KVC_KV_BF16; }

static int kivi(const kvc_kv *kv) { return kvc_kv_type_key_blocks(kv->fmt.type); }
/* KIVI quantises once this many rows wait (max(residual, group)); rows stored alone always (0) */
static int64_t wait_limit(const kvc_kv *kv) {
    return kivi(kv) ? (kv->fmt.residual > kv->fmt.group ? kv->fmt.residual : kv->fmt.group) : 0;
}
/* staging rows a head keeps between calls: after a commit fewer than wait_limit rows wait, a step adds one */
static int64_t stage_keep(const kvc_kv *kv) { return wait_limit(kv) + 8; }

static int capturing(void) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(g.stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone;
}

static unsigned blocks_for(int64_t items) {
    const int64_t b = (items + KVT_THREADS - 1) / KVT_THREADS;
    return (unsigned)(b < 1 ? 1 : b > KVT_MAX_BLOCKS ? KVT_MAX_BLOCKS : b);
}

TypedRows typed_rows(const kvc_kv *kv) {
    TypedRows t;
    t.tab = kv->tabd;
    t.f = kv->fmt;
    t.d = kv->d;
    t.krow = kv->krow;
    t.vrow = kv->vrow;
    t.kblock = kv->kblock;
    return t;
}

/* ---- the device table and state ---- */

static int32_t *nq_dev(const kvc_kv *kv) { return (int32_t *)((char *)kv->tabd + offsetof(KvTab, nq)); }

/* the host copy's fields before nq (pointers, np, dk) to the device; nq stays the device's */
static kvc_status tab_put(kvc_kv *kv) {
    CU_TRY(h2d(kv->tabd, &kv->tabh, offsetof(KvTab, nq)), "K/V table");
    CU_TRY(stream_wait(), "K/V table");
    return KVC_OK;
}

static kvc_status ints_put(int32_t *dst, const int64_t *v, int32_t n, const char *what) {
    int32_t v32[KVC_MAX_KV];
    for (int32_t h = 0; h < n; h++) v32[h] = (int32_t)v[h];
    CU_TRY(h2d(dst, v32, sizeof(int32_t) * n), what);
    CU_TRY(stream_wait(), what); /* v32 lives on this stack frame */
    return KVC_OK;
}

/* the device lengths and nq, in one wait */
static kvc_status state_get(const kvc_kv *kv, int64_t *len, int64_t *nq) {
    int32_t l32[KVC_MAX_KV], q32[KVC_MAX_KV];
    CU_TRY(d2h(l32, kv->lend, sizeof(int32_t) * kv->Hkv), "K/V state");
    CU_TRY(d2h(q32, nq_dev(kv), sizeof(int32_t) * kv->Hkv), "K/V state");
    CU_TRY(stream_wait(), "K/V state");
    for (int32_t h = 0; h < kv->Hkv; h++) {
        len[h] = l32[h];
        nq[h] = q32[h];
    }
    return KVC_OK;
}

kvc_status kvt_init(kvc_kv *kv, const kvc_kv_format *fmt) {
    const int32_t d = kv->d, t = fmt->type;
    if (t != KVC_KV_F32 && t != KVC_KV_F16 && t != KVC_KV_Q8_0 && t != KVC_KV_KIVI4 && t != KVC_KV_KIVI2)
        return fail(KVC_ERR_ARG, "K/V cache type %d is not one the CUDA backend stores (f32, bf16, f16, q8_0, kivi4, kivi2)", t);
    if (d % 8 != 0 || d > 256)
        return fail(KVC_ERR_UNSUPPORTED, "the CUDA K/V store of a quantised type needs head_dim a multiple of 8, at most 256 (got %d)", d);
    if (kvc_kv_type_key_blocks(t)) { /* kvc_kv_format_check said so first; a store never takes a format it cannot lay out */
        const int32_t per = 8 / kvc_kv_type_bits(t), gv = kvc_kivi_vgroup(fmt->group, d);
        if (fmt->group < 1 || fmt->group > 4096 || fmt->residual < 0 || fmt->residual > (1 << 20) || d % gv != 0 || gv % per != 0)
            return fail(KVC_ERR_ARG, "QuantizedCache: q_group_size %d and residual_length %d do not fit head_dim %d",
                        fmt->group, fmt->residual, d);
    }
    kv->typed = 1;
    kv->fmt = *fmt;
    kv->krow = kv->vrow = kvc_kv_row_bytes(fmt, d);
    kv->kblock = kvc_kv_type_key_blocks(t) ? kvc_kivi_block_bytes(fmt, d) : 0;
    kv->tab_bytes = sizeof(KvTab) + sizeof(int32_t) * (size_t)kv->Hkv * d;
    KVC_TRY(dalloc((void **)&kv->tabd, kv->tab_bytes, MEM_CACHE, "K/V table"));
    memset(&kv->tabh, 0, sizeof kv->tabh);
    kv->tabh.inv = (int32_t *)((char *)kv->tabd + sizeof(KvTab));
    CU_TRY(cudaMemsetAsync(kv->tabd, 0, kv->tab_bytes, g.stream), "K/V table");
    return tab_put(kv);
}

void kvt_free(kvc_kv *kv) {
    if (!kv->typed) return;
    if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
    if (kv->tabd) dfree(kv->tabd, kv->tab_bytes, MEM_CACHE);
    kv->stage = nullptr;
    kv->tabd = nullptr;
}

size_t kvt_bytes(const kvc_kv *kv) { return kv->bytes + kv->sbytes; }

/* ---- staging rows: per head [scap, 2d] f32 ---- */

/* staging rows of `rows` a head, each head's first `keep` rows carried over (eagerly: a graph reads the table) */
static kvc_status stage_resize(kvc_kv *kv, int64_t rows, int64_t keep) {
    if (rows == kv->scap) return KVC_OK;
    if (capturing())
        return fail(KVC_ERR_UNSUPPORTED, "CUDA K/V staging rows must grow during a graph capture: run one eager step first");
    const int32_t Hkv = kv->Hkv;
    const size_t row = sizeof(float) * 2 * (size_t)kv->d, bytes = row * (size_t)Hkv * (size_t)rows;
    float *p = nullptr;
    if (bytes) KVC_TRY(dalloc((void **)&p, bytes, MEM_CACHE, "K/V staging rows"));
    keep = keep < rows ? keep : rows;
    keep = keep < kv->scap ? keep : kv->scap;
    if (keep > 0 &&
        cudaMemcpy2DAsync(p, row * (size_t)rows, kv->stage, row * (size_t)kv->scap, row * (size_t)keep, (size_t)Hkv,
                          cudaMemcpyDeviceToDevice, g.stream) != cudaSuccess) {
        const kvc_status st = cuda_fail(cudaGetLastError(), "K/V staging rows");
        stream_wait();
        dfree(p, bytes, MEM_CACHE);
        return st;
    }
    const KvTab old = kv->tabh;
    for (int32_t h = 0; h < Hkv; h++) kv->tabh.st[h] = p ? p + (size_t)h * rows * 2 * kv->d : nullptr;
    const kvc_status st = tab_put(kv);
    if (st != KVC_OK) {
        kv->tabh = old;
        tab_put(kv);
        if (p) dfree(p, bytes, MEM_CACHE);
        return st;
    }
    if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
    kv->stage = p;
    kv->scap = rows;
    kv->sbytes = bytes;
    return KVC_OK;
}

/* room for `rows` staging rows a head (grown by half again), every row held carried over */
static kvc_status stage_room(kvc_kv *kv, int64_t rows) {
    if (rows <= kv->scap) return KVC_OK;
    const int64_t want = rows + rows / 2 > stage_keep(kv) ? rows + rows / 2 : stage_keep(kv);
    return stage_resize(kv, want, kv->scap);
}

/* ---- append and commit (graph-safe: lengths and nq from the device) ---- */

__global__ void stage_append_kernel(const KvTab *__restrict__ tab, const bf16 *__restrict__ src, int64_t ld, int64_t kcol,
                                    int64_t vcol, int32_t d, const int32_t *__restrict__ len) {
    const int64_t i = blockIdx.x;
    const int h = blockIdx.y;
    float *s = tab->st[h] + ((int64_t)len[h] - tab->nq[h] + i) * 2 * d;
    const bf16 *ks = src + i * ld + kcol + (int64_t)h * d, *vs = src + i * ld + vcol + (int64_t)h * d;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        s[e] = __bfloat162float(ks[e]);
        s[d + e] = __bfloat162float(vs[e]);
    }
}

kvc_status kvt_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n) {
    if (n <= 0) return KVC_OK;
    const int64_t need = kv->wait_max + n;
    KVC_TRY(stage_room(kv, need));
    dim3 grid((unsigned)n, (unsigned)kv->Hkv);
    stage_append_kernel<<<grid, kv->d < 128 ? kv->d : 128, 0, g.stream>>>(kv->tabd, at<bf16>(src), src.ld, kcol, vcol, kv->d,
                                                                          kv->lend);
    LAUNCH_TRY("K/V append (staging rows)");
    kv->wait_max = need;
    return add_lens(kv->lend, kv->Hkv, (int32_t)n);
}

/* the rows that go into the type now: rows stored alone every waiting row, KIVI every whole block once `limit` wait */
__device__ __forceinline__ int64_t commit_rows(const kvc_kv_format &f, int64_t waiting, int64_t limit) {
    if (!kvc_kv_type_key_blocks(f.type)) return waiting;
    return waiting >= limit ? waiting / f.group * f.group : 0;
}

/* The waiting rows' values (and keys stored alone) one row a thread; KIVI key blocks `per` channels a thread (the
 * code bytes a thread writes are its own: kv_type.h's encode_cols). */
__global__ void commit_encode_kernel(const TypedRows t, const int32_t *__restrict__ len, int64_t limit) {
    const int h = blockIdx.y;
    const KvTab *tab = t.tab;
    const int64_t nq = tab->nq[h], m = commit_rows(t.f, (int64_t)len[h] - nq, limit);
    if (m <= 0) return;
    const int kb = kvc_kv_type_key_blocks(t.f.type);
    const int32_t d = t.d, per = kb ? 8 / kvc_kv_type_bits(t.f.type) : 1;
    const int64_t G = t.f.group, chunks = kb ? d / per : 0, items = m + (kb ? m / G * chunks : 0);
    const float *st = tab->st[h];
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items; it += (int64_t)gridDim.x * blockDim.x) {
        if (it < m) {
            const float *x = st + it * 2 * d;
            kvc_kv_encode_row(&t.f, x + d, d, tab->v[h] + (nq + it) * t.vrow);
            if (!kb) kvc_kv_encode_row(&t.f, x, d, tab->k[h] + (nq + it - tab->np[h]) * t.krow);
        } else {
            const int64_t j = it - m, b = j / chunks;
            kvc_kivi_encode_cols(&t.f, st + b * G * 2 * d, 2 * (size_t)d, d, (int32_t)(j % chunks) * per, per,
                                 tab->k[h] + (nq / G + b) * t.kblock);
        }
    }
}

/* then, one block a head: KIVI's rows left (fewer than a block) move to the front of the staging rows (they do not
 * overlap the rows moved from: fewer than `group` after at least `group`), and nq moves past the rows encoded */
__global__ void commit_settle_kernel(const TypedRows t, KvTab *tab, const int32_t *__restrict__ len, int64_t limit) {
    const int h = blockIdx.x;
    const int64_t nq = tab->nq[h], c = (int64_t)len[h] - nq, m = commit_rows(t.f, c, limit);
    if (m <= 0) return; /* the whole block returns */
    float *st = tab->st[h];
    const int64_t d2 = 2 * (int64_t)t.d;
    for (int64_t i = threadIdx.x; i < (c - m) * d2; i += blockDim.x) st[i] = st[m * d2 + i];
    __syncthreads();
    if (threadIdx.x == 0) tab->nq[h] = (int32_t)(nq + m);
}

kvc_status kvt_commit(kvc_kv *kv) {
    const int64_t limit = wait_limit(kv);
    const int cap = capturing();
    /* eagerly the host's bound says whether anything can go into the type; a capture records the kernels whatever
     * waits now, since its replays see other counts */
    if (!cap && (kv->wait_max <= 0 || kv->wait_max < limit)) return KVC_OK;
    const int32_t d = kv->d, per = kivi(kv) ? 8 / kvc_kv_type_bits(kv->fmt.type) : 1;
    const int64_t rows = kv->wait_max > limit ? kv->wait_max : limit;
    const int64_t items = rows + (kivi(kv) ? rows / kv->fmt.group * (d / per) : 0);
    const TypedRows t = typed_rows(kv);
    dim3 grid(blocks_for(items), (unsigned)kv->Hkv);
    commit_encode_kernel<<<grid, KVT_THREADS, 0, g.stream>>>(t, kv->lend, limit);
    LAUNCH_TRY("K/V commit");
    commit_settle_kernel<<<(unsigned)kv->Hkv, KVT_THREADS, 0, g.stream>>>(t, kv->tabd, kv->lend, limit);
    LAUNCH_TRY("K/V commit");
    /* what waits after: nothing (rows stored alone), fewer than limit rows (KIVI); after a capture the bound of
     * every replay */
    kv->wait_max = !kivi(kv) ? 0 : cap ? limit - 1 : kv->wait_max < limit - 1 ? kv->wait_max : limit - 1;
    /* a prefill's worth of staging rows goes once committed; a decode step's keep their room */
    if (!cap && kv->scap > stage_keep(kv)) {
        const int64_t keep = kv->wait_max > stage_keep(kv) ? kv->wait_max : stage_keep(kv);
        if (keep < kv->scap) return stage_resize(kv, keep, kv->wait_max);
    }
    return KVC_OK;
}

/* ---- rows of every head: the lists the layout kernels walk ---- */

/* head h has rows it in [off[h], off[h + 1]) of the list: its row first[h] + (it - off[h]), or rows[it] */
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

/* Rows of `from` as f32 or bf16 (channels 8 at a time; pruned channels zero) into k and v (either may be NULL):
 * list entry it at row it of the output (the scorers' and the reads' rows), or head h's staging row it - off[h]
 * (st: staging rows, stride 2d; the rebuilds and KIVI's rows back to f32). */
__global__ void rows_out_kernel(const TypedRows from, const RowList L, int32_t Hkv, void *k, void *v, int bf16_out,
                                float *const *st) {
    const int32_t d = from.d, chunks = d / 8;
    const int64_t total = L.off[Hkv] * chunks;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < total; it += (int64_t)gridDim.x * blockDim.x) {
        const int64_t item = it / chunks;
        const int c0 = (int)(it % chunks) * 8, h = L.head_of(item, Hkv);
        const int64_t r = L.row(h, item);
        const TypedRows::Head src = from.head(h, d);
        float x[8];
        if (st) {
            float *s = st[h] + (item - L.off[h]) * 2 * d + c0;
            src.key<8>(r, c0, x);
            for (int t = 0; t < 8; t++) s[t] = x[t];
            src.value<8>(r, c0, x);
            for (int t = 0; t < 8; t++) s[d + t] = x[t];
            continue;
        }
        for (int pass = 0; pass < 2; pass++) {
            void *out = pass ? v : k;
            if (!out) continue;
            if (pass) src.value<8>(r, c0, x);
            else src.key<8>(r, c0, x);
            if (bf16_out) *(uint4 *)((bf16 *)out + item * d + c0) = pack8_bf16(x);
            else
                for (int t = 0; t < 8; t++) ((float *)out)[item * d + c0 + t] = x[t];
        }
    }
}

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

/* Host f32 rows written, one row a thread: rows stored alone encoded in place (a pruned row keeps its kept channels),
 * KIVI into its staging row (nq from the device; a pruned row's dropped channels zero). */
__global__ void write_rows_kernel(const TypedRows t, const RowList L, int32_t Hkv, const float *__restrict__ k,
                                  const float *__restrict__ v) {
    const int32_t d = t.d;
    const int kb = kvc_kv_type_key_blocks(t.f.type);
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < L.off[Hkv]; it += (int64_t)gridDim.x * blockDim.x) {
        const int h = L.head_of(it, Hkv);
        const int64_t r = L.row(h, it);
        const TypedRows::Head hd = t.head(h, d);
        const float *kx = k ? k + it * d : nullptr, *vx = v ? v + it * d : nullptr;
        if (kb) {
            float *s = t.tab->st[h] + (r - hd.nq) * 2 * d;
            for (int c = 0; c < d; c++) {
                if (kx) s[c] = r < hd.np && hd.inv[c] < 0 ? 0.f : kx[c];
                if (vx) s[d + c] = vx[c];
            }
            continue;
        }
        if (kx && r < hd.np) {
            float nar[256];
            for (int c = 0; c < d; c++)
                if (hd.inv[c] >= 0) nar[hd.inv[c]] = kx[c];
            kvc_kv_encode_row(&t.f, nar, hd.dk, t.tab->kp[h] + r * hd.kprow);
        } else if (kx) {
            kvc_kv_encode_row(&t.f, kx, d, t.tab->k[h] + (r - hd.np) * t.krow);
        }
        if (vx) kvc_kv_encode_row(&t.f, vx, d, t.tab->v[h] + r * t.vrow);
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

/* ---- list uploads ---- */

/* the rows of a list (rows[h][0 .. n[h]) or NULL) and an optional channel map [Hkv d], as one int32 upload */
static kvc_status list_put(const kvc_kv *kv, const int64_t *const *rows, const int64_t *n, const int32_t *inv, RowList *L,
                           const int32_t **inv_d) {
    const int32_t Hkv = kv->Hkv;
    int64_t total = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        L->off[h] = total;
        L->first[h] = 0;
        total += n[h];
    }
    L->off[Hkv] = total;
    L->rows = nullptr;
    if (inv_d) *inv_d = nullptr;
    const int64_t nmap = inv ? (int64_t)Hkv * kv->d : 0, count = (rows ? total : 0) + nmap;
    if (count == 0) return KVC_OK;
    if (count >= 2147483647) return fail(KVC_ERR_ARG, "K/V rows: %lld in one call", (long long)count);
    KVC_TRY(g_pin_t.need(sizeof(int32_t) * (size_t)count, "K/V rows (pinned)"));
    KVC_TRY(scratch(g_idx_t, sizeof(int32_t) * (size_t)count, "K/V rows"));
    int32_t *p = g_pin_t.as<int32_t>();
    if (inv) memcpy(p, inv, sizeof(int32_t) * (size_t)nmap);
    if (rows)
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t i = 0; i < n[h]; i++) p[nmap + L->off[h] + i] = (int32_t)rows[h][i];
    CU_TRY(h2d(g_idx_t.p, p, sizeof(int32_t) * (size_t)count), "K/V rows");
    CU_TRY(stream_wait(), "K/V rows"); /* the pinned block is the next call's */
    if (inv_d) *inv_d = g_idx_t.as<int32_t>();
    if (rows) L->rows = g_idx_t.as<int32_t>() + nmap;
    return KVC_OK;
}

/* the channel map of dk kept channels kidx [Hkv dk] (channel -> slot, or -1) */
static void channel_map(int32_t Hkv, int32_t d, int32_t dk, const int32_t *kidx, int32_t *inv) {
    for (int32_t h = 0; h < Hkv; h++) {
        for (int32_t c = 0; c < d; c++) inv[(size_t)h * d + c] = -1;
        for (int32_t j = 0; j < dk; j++) inv[(size_t)h * d + kidx[(size_t)h * dk + j]] = j;
    }
}

/* ---- KIVI: rows back to staging ---- */

/* Rows [r0[h], held[h]) of every head as staging rows (r0 a block's start at or below nq), room for `room` rows a
 * head: blocks below nq turn back to f32 so that writes and cuts there see rows in f32 (kv_store.c's
 * unquantise_from); nq becomes r0. */
static kvc_status unquantise(kvc_kv *kv, const int64_t *r0, const int64_t *held, int64_t room) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t cnt[KVC_MAX_KV], most = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        cnt[h] = held[h] > r0[h] ? held[h] - r0[h] : 0;
        most = cnt[h] > most ? cnt[h] : most;
    }
    int64_t rows = room > most ? room : most;
    rows = rows > stage_keep(kv) ? rows : stage_keep(kv);
    const size_t bytes = sizeof(float) * 2 * (size_t)d * (size_t)Hkv * (size_t)rows;
    float *p = nullptr;
    KVC_TRY(dalloc((void **)&p, bytes, MEM_CACHE, "K/V staging rows"));
    RowList L;
    KVC_TRY(list_put(kv, nullptr, cnt, nullptr, &L, nullptr));
    const KvTab old = kv->tabh;
    for (int32_t h = 0; h < Hkv; h++) {
        L.first[h] = r0[h];
        kv->tabh.st[h] = p + (size_t)h * rows * 2 * d;
    }
    /* the new staging rows' table: a device copy of the host's pointers, read by the kernel */
    KVC_TRY(scratch(g_rows_t, sizeof(float *) * (size_t)Hkv, "K/V staging table"));
    kvc_status st = KVC_OK;
    if (h2d(g_rows_t.p, kv->tabh.st, sizeof(float *) * (size_t)Hkv) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "K/V staging table");
    if (st == KVC_OK && L.off[Hkv] > 0) {
        rows_out_kernel<<<blocks_for(L.off[Hkv] * (d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, nullptr, nullptr,
                                                                                        0, g_rows_t.as<float *>());
        st = check_launch("K/V rows back to f32");
    }
    if (st == KVC_OK) st = tab_put(kv); /* after the kernel read the old table (stream order) */
    if (st == KVC_OK) st = ints_put(nq_dev(kv), r0, Hkv, "K/V state");
    if (st != KVC_OK) {
        kv->tabh = old;
        tab_put(kv);
        dfree(p, bytes, MEM_CACHE);
        return st;
    }
    if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
    kv->stage = p;
    kv->scap = rows;
    kv->sbytes = bytes;
    kv->wait_max = most;
    return KVC_OK;
}

/* ---- rebuilds ---- */

static kvc_kv_slices typed_slices(const kvc_kv *kv, int32_t dk, int64_t cap, int64_t np) {
    const kvc_kv_format *f = &kv->fmt;
    if (kivi(kv)) np = 0;
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
    const int kb = kivi(kv);
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
        KVC_TRY(state_get(from, held, nq));
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
    kvc_status st = list_put(kv, keep ? rows_of : nullptr, cnt, inv, &L, &inv_d);
    for (int32_t h = 0; h < Hkv; h++) L.first[h] = whole[h];
    /* the arena (and KIVI's staging rows) */
    size_t bytes = 0, sbytes = 0;
    for (int32_t h = 0; h < Hkv; h++) bytes += typed_slices(kv, dk, cap[h], np[h]).bytes;
    /* staging rows: an empty store has none (a cleared cache holds nothing); KIVI's new ones hold its staged rows
     * and the room of the appends to come (a graph's capture must not grow them); rows stored alone keep theirs */
    const int64_t scap = !rows_held ? 0 : kb ? (most > stage_keep(kv) ? most : stage_keep(kv)) : kv->scap;
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
        if (st == KVC_OK) st = scratch(g_rows_t, sizeof(float *) * (size_t)Hkv, "K/V staging table");
        if (st == KVC_OK && h2d(g_rows_t.p, nt.st, sizeof(float *) * (size_t)Hkv) != cudaSuccess)
            st = cuda_fail(cudaGetLastError(), "K/V staging table");
        if (st == KVC_OK && L.off[Hkv] > 0) {
            rows_out_kernel<<<blocks_for(L.off[Hkv] * (d / 8)), KVT_THREADS, 0, g.stream>>>(src, L, Hkv, nullptr, nullptr, 0,
                                                                                            g_rows_t.as<float *>());
            st = check_launch("K/V rebuild (staging rows)");
        }
    } else if (st == KVC_OK && L.off[Hkv] > 0) {
        rebuild_rows_kernel<<<blocks_for(L.off[Hkv]), KVT_THREADS, 0, g.stream>>>(src, L, Hkv, dst);
        st = check_launch("K/V rebuild");
    }
    /* the store's table and state follow (stream order: after the kernels read from's) */
    if (st == KVC_OK) {
        kv->tabh = nt;
        st = tab_put(kv);
    }
    if (st == KVC_OK && dk && cudaMemcpyAsync(kv->tabh.inv, inv_d, sizeof(int32_t) * (size_t)Hkv * d, cudaMemcpyDeviceToDevice,
                                              g.stream) != cudaSuccess)
        st = cuda_fail(cudaGetLastError(), "K/V channel map");
    if (st == KVC_OK) st = ints_put(nq_dev(kv), kb ? whole : n, Hkv, "K/V state");
    if (st == KVC_OK) st = ints_put(kv->lend, n, Hkv, "K/V lengths");
    free(inv);
    if (st != KVC_OK) { /* the store keeps its old arena and table */
        stream_wait();
        kv->tabh = old;
        tab_put(kv);
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
    if (!kivi(kv)) { /* every row held becomes a narrow row: a new arena */
        KVC_TRY(kvt_commit(kv));
        KVC_TRY(kv_host_lens(kv, held));
        for (int32_t h = 0; h < Hkv; h++) cap[h] = kv->cap[h];
        return rebuild(kv, kv, cap, nullptr, held, held, dk, kidx);
    }
    /* KIVI keeps the width: the dropped channels become zeros in place (channels dropped before are zeros already) */
    int32_t *ixc = (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * dk), *inv = (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * d);
    kvc_status st = !ixc || !inv ? fail(KVC_ERR_NOMEM, "out of memory: K/V prune") : state_get(kv, held, nq);
    if (st == KVC_OK) {
        memcpy(ixc, kidx, sizeof(int32_t) * (size_t)Hkv * dk);
        channel_map(Hkv, d, dk, ixc, inv);
        if (h2d(kv->tabh.inv, inv, sizeof(int32_t) * (size_t)Hkv * d) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "K/V channel map");
    }
    int64_t most = 0;
    for (int32_t h = 0; h < Hkv; h++) most = held[h] > most ? held[h] : most;
    if (st == KVC_OK && most > 0) {
        dim3 grid(blocks_for(most * d), (unsigned)Hkv);
        prune_blocks_kernel<<<grid, KVT_THREADS, 0, g.stream>>>(typed_rows(kv), kv->lend);
        st = check_launch("K/V prune");
    }
    if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) kv->tabh.np[h] = (int32_t)held[h];
        kv->tabh.dk = dk;
        st = tab_put(kv);
    }
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
    if (!kivi(kv)) {
        KVC_TRY(kvt_commit(kv));
        if (into_pruned) { /* the narrow prefix shrinks: later rows are full again, a new arena */
            int64_t np[KVC_MAX_KV], cap[KVC_MAX_KV];
            for (int32_t h = 0; h < Hkv; h++) {
                np[h] = len[h] < kv->np[h] ? len[h] : kv->np[h];
                cap[h] = kv->cap[h];
            }
            return rebuild(kv, kv, cap, nullptr, len, np, kv->dk, kv->kidx);
        }
        KVC_TRY(ints_put(nq_dev(kv), len, Hkv, "K/V state")); /* rows past the old length were written typed */
        kv->wait_max = 0;
        return ints_put(kv->lend, len, Hkv, "K/V lengths");
    }
    int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV], r0[KVC_MAX_KV];
    KVC_TRY(state_get(kv, held, nq));
    int back = 0;
    int64_t need = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        r0[h] = len[h] < nq[h] ? len[h] / kv->fmt.group * kv->fmt.group : nq[h];
        back |= r0[h] < nq[h];
        need = len[h] - r0[h] > need ? len[h] - r0[h] : need;
    }
    if (back) KVC_TRY(unquantise(kv, r0, held, need));
    KVC_TRY(stage_room(kv, need));
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
    KVC_TRY(tab_put(kv));
    kv->wait_max = need;
    return ints_put(kv->lend, len, Hkv, "K/V lengths");
}

/* ---- host rows ---- */

kvc_status kvt_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v, int commit) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t total = 0;
    for (int32_t h = 0; h < Hkv; h++) total += n[h];
    if (total == 0 || (!k && !v)) return KVC_OK;
    if (!kivi(kv)) {
        KVC_TRY(kvt_commit(kv)); /* then rows are written in the type wherever they lie */
    } else { /* KIVI: rows in f32 from the block of the lowest row written on; kv_commit quantises them again */
        int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV], r0[KVC_MAX_KV], top[KVC_MAX_KV], room = 0;
        int back = 0;
        KVC_TRY(state_get(kv, held, nq));
        for (int32_t h = 0; h < Hkv; h++) {
            int64_t lo = nq[h], hi = held[h];
            for (int64_t i = 0; i < n[h]; i++) {
                lo = idx[h][i] < lo ? idx[h][i] : lo;
                hi = idx[h][i] + 1 > hi ? idx[h][i] + 1 : hi;
            }
            r0[h] = lo < nq[h] ? lo / kv->fmt.group * kv->fmt.group : nq[h];
            top[h] = hi;
            back |= r0[h] < nq[h];
            room = top[h] - r0[h] > room ? top[h] - r0[h] : room;
        }
        if (back) KVC_TRY(unquantise(kv, r0, held, room));
        KVC_TRY(stage_room(kv, room));
        for (int32_t h = 0; h < Hkv; h++) kv->wait_max = held[h] - r0[h] > kv->wait_max ? held[h] - r0[h] : kv->wait_max;
    }
    RowList L;
    KVC_TRY(list_put(kv, idx, n, nullptr, &L, nullptr));
    const int64_t vals = total * d, parts = (k != nullptr) + (v != nullptr);
    KVC_TRY(g_pin_t.need(sizeof(float) * (size_t)(vals * parts), "K/V write (pinned)"));
    KVC_TRY(scratch(g_rows_t, sizeof(float) * (size_t)(vals * parts), "K/V write rows"));
    if (k) memcpy(g_pin_t.p, k, sizeof(float) * (size_t)vals);
    if (v) memcpy(g_pin_t.as<float>() + (k ? vals : 0), v, sizeof(float) * (size_t)vals);
    CU_TRY(h2d(g_rows_t.p, g_pin_t.p, sizeof(float) * (size_t)(vals * parts)), "K/V write");
    const float *kd = k ? g_rows_t.as<float>() : nullptr, *vd = v ? g_rows_t.as<float>() + (k ? vals : 0) : nullptr;
    write_rows_kernel<<<blocks_for(total), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kd, vd);
    LAUNCH_TRY("K/V write");
    CU_TRY(stream_wait(), "K/V write");
    return commit && kivi(kv) ? kvt_commit(kv) : KVC_OK;
}

kvc_status kvt_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    RowList L;
    KVC_TRY(list_put(kv, nullptr, rows, nullptr, &L, nullptr));
    for (int32_t h = 0; h < Hkv; h++) L.first[h] = row0 ? row0[h] : 0;
    const int64_t total = L.off[Hkv], vals = total * d, parts = (k != nullptr) + (v != nullptr);
    if (total == 0 || parts == 0) return KVC_OK;
    KVC_TRY(scratch(g_rows_t, sizeof(float) * (size_t)(vals * parts), "K/V read staging"));
    KVC_TRY(g_pin_t.need(sizeof(float) * (size_t)(vals * parts), "K/V read (pinned)"));
    float *kd = k ? g_rows_t.as<float>() : nullptr, *vd = v ? g_rows_t.as<float>() + (k ? vals : 0) : nullptr;
    rows_out_kernel<<<blocks_for(total * (d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kd, vd, 0, nullptr);
    LAUNCH_TRY("K/V read");
    CU_TRY(d2h(g_pin_t.p, g_rows_t.p, sizeof(float) * (size_t)(vals * parts)), "K/V read");
    CU_TRY(stream_wait(), "K/V read");
    if (k) memcpy(k, g_pin_t.p, sizeof(float) * (size_t)vals);
    if (v) memcpy(v, g_pin_t.as<float>() + (k ? vals : 0), sizeof(float) * (size_t)vals);
    return KVC_OK;
}

kvc_status kvt_rows_bf16(const kvc_kv *kv, const bf16 **k, const bf16 **v) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t held[KVC_MAX_KV];
    KVC_TRY(kv_host_lens(kv, held));
    RowList L;
    KVC_TRY(list_put(kv, nullptr, held, nullptr, &L, nullptr));
    const int64_t total = L.off[Hkv];
    KVC_TRY(scratch(g_exp_t, sizeof(bf16) * 2 * (size_t)(total > 0 ? total : 1) * d, "K/V rows for the scorers"));
    bf16 *kx = g_exp_t.as<bf16>(), *vx = kx + (size_t)total * d;
    for (int32_t h = 0; h < Hkv; h++) {
        k[h] = kx + (size_t)L.off[h] * d;
        v[h] = vx + (size_t)L.off[h] * d;
    }
    if (total == 0) return KVC_OK;
    rows_out_kernel<<<blocks_for(total * (d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kx, vx, 1, nullptr);
    LAUNCH_TRY("K/V rows for the scorers");
    return KVC_OK;
}

} // namespace kvc
