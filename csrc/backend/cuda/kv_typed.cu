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
 * A failed call on a KIVI store loses nothing (core/kv_undo.h's rule, as kv_store.c): the append kernel sets each
 * head's mark on the device, the commit keeps the rows of earlier calls it quantises as undo rows (device memory
 * of max(residual, group) rows a head at least, sized eagerly like the staging rows), and a cut back to the mark
 * (kv_set_lens, the engine's roll-back) takes them back to f32 as they were; so a decode graph's replays keep them.
 * This file: the store, its staging rows, append and commit, the host's rows (reads, writes, the scorers' copy);
 * kv_typed_layout.cu: the rebuilds, ThinK and truncation.
 * Compile-only in this project's CI (no GPU): the emulated device runs the host store these kernels follow. */
#include <stdlib.h>
#include <string.h>

#include "kv_typed.cuh"

namespace kvc {

static Buf g_idx_t, g_rows_t, g_exp_t, g_st_t; /* row lists and channel maps; f32 rows of reads and writes; the
                                                  scorers' rows; a staging table */
static Pinned g_pin_t;                         /* the host side of the batched reads and writes */

static_assert(offsetof(KvTab, un) == offsetof(KvTab, mark) + 2 * sizeof(int32_t) * KVC_MAX_KV, "undo state in one block");

int kvt_is_typed(const kvc_kv_format *f) { return f->type != KVC_KV_NATIVE && f->type != KVC_KV_BF16; }

int kvt_capturing(void) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(g.stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone;
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

kvc_status kvt_tab_put(kvc_kv *kv) {
    CU_TRY(h2d(kv->tabd, &kv->tabh, offsetof(KvTab, nq)), "K/V table");
    CU_TRY(stream_wait(), "K/V table");
    return KVC_OK;
}

kvc_status kvt_ints_put(int32_t *dst, const int64_t *v, int32_t n, const char *what) {
    int32_t v32[KVC_MAX_KV];
    for (int32_t h = 0; h < n; h++) v32[h] = (int32_t)v[h];
    CU_TRY(h2d(dst, v32, sizeof(int32_t) * n), what);
    CU_TRY(stream_wait(), what); /* v32 lives on this stack frame */
    return KVC_OK;
}

kvc_status kvt_state_get(const kvc_kv *kv, int64_t *len, int64_t *nq) {
    int32_t l32[KVC_MAX_KV], q32[KVC_MAX_KV];
    CU_TRY(d2h(l32, kv->lend, sizeof(int32_t) * kv->Hkv), "K/V state");
    CU_TRY(d2h(q32, kvt_nq_dev(kv), sizeof(int32_t) * kv->Hkv), "K/V state");
    CU_TRY(stream_wait(), "K/V state");
    for (int32_t h = 0; h < kv->Hkv; h++) {
        len[h] = l32[h];
        nq[h] = q32[h];
    }
    return KVC_OK;
}

kvc_status kvt_undo_get(const kvc_kv *kv, int64_t *mark, int64_t *u0, int64_t *un) {
    int32_t s[3 * KVC_MAX_KV];
    CU_TRY(d2h(s, kvt_undo_dev(kv), sizeof s), "K/V undo state");
    CU_TRY(stream_wait(), "K/V undo state");
    for (int32_t h = 0; h < kv->Hkv; h++) {
        mark[h] = s[h];
        u0[h] = s[KVC_MAX_KV + h];
        un[h] = s[2 * KVC_MAX_KV + h];
    }
    return KVC_OK;
}

kvc_status kvt_undo_set(kvc_kv *kv, const int64_t *mark, const int64_t *un) {
    KVC_TRY(kvt_ints_put(kvt_undo_dev(kv), mark, kv->Hkv, "K/V undo state"));
    return kvt_ints_put(kvt_undo_dev(kv) + 2 * KVC_MAX_KV, un, kv->Hkv, "K/V undo state");
}

kvc_status kvt_undo_forget(kvc_kv *kv) {
    int64_t mark[KVC_MAX_KV], un[KVC_MAX_KV];
    for (int32_t h = 0; h < kv->Hkv; h++) {
        mark[h] = -1;
        un[h] = 0;
    }
    return kvt_undo_set(kv, mark, un);
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
    KVC_TRY(kvt_tab_put(kv));
    return kvt_undo_forget(kv);
}

void kvt_free(kvc_kv *kv) {
    if (!kv->typed) return;
    if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
    if (kv->undo) dfree(kv->undo, kv->ubytes, MEM_CACHE);
    if (kv->tabd) dfree(kv->tabd, kv->tab_bytes, MEM_CACHE);
    kv->stage = nullptr;
    kv->undo = nullptr;
    kv->tabd = nullptr;
}

size_t kvt_bytes(const kvc_kv *kv) { return kv->bytes + kv->sbytes + kv->ubytes; }

/* ---- staging rows: per head [scap, 2d] f32 ---- */

/* staging rows of `rows` a head, each head's first `keep` rows carried over (eagerly: a graph reads the table) */
static kvc_status stage_resize(kvc_kv *kv, int64_t rows, int64_t keep) {
    if (rows == kv->scap) return KVC_OK;
    if (kvt_capturing())
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
    const kvc_status st = kvt_tab_put(kv);
    if (st != KVC_OK) {
        kv->tabh = old;
        kvt_tab_put(kv);
        if (p) dfree(p, bytes, MEM_CACHE);
        return st;
    }
    if (kv->stage) dfree(kv->stage, kv->sbytes, MEM_CACHE);
    kv->stage = p;
    kv->scap = rows;
    kv->sbytes = bytes;
    return KVC_OK;
}

kvc_status kvt_stage_room(kvc_kv *kv, int64_t rows) {
    if (rows <= kv->scap) return KVC_OK;
    const int64_t want = rows + rows / 2 > kvt_stage_keep(kv) ? rows + rows / 2 : kvt_stage_keep(kv);
    return stage_resize(kv, want, kv->scap);
}

/* ---- KIVI's undo rows: per head [ucap, 2d] f32 (core/kv_undo.h) ---- */

/* Room for `rows` undo rows a head (at least max(residual, group): what a decode step's commit keeps), eagerly:
 * called as an append or a write begins, which drops the undo rows held (so none is carried over). */
static kvc_status undo_room(kvc_kv *kv, int64_t rows) {
    const int64_t want = rows > kvt_wait_limit(kv) ? rows : kvt_wait_limit(kv);
    if (want <= kv->tabh.ucap) return KVC_OK;
    if (kvt_capturing())
        return fail(KVC_ERR_UNSUPPORTED, "CUDA K/V undo rows must grow during a graph capture: run one eager step first");
    const int32_t Hkv = kv->Hkv;
    const size_t bytes = sizeof(float) * 2 * (size_t)kv->d * (size_t)Hkv * (size_t)want;
    float *p = nullptr;
    KVC_TRY(dalloc((void **)&p, bytes, MEM_CACHE, "K/V undo rows"));
    const KvTab old = kv->tabh;
    for (int32_t h = 0; h < Hkv; h++) kv->tabh.uk[h] = p + (size_t)h * want * 2 * kv->d;
    kv->tabh.ucap = want;
    kvc_status st = kvt_tab_put(kv);
    if (st == KVC_OK && cudaMemsetAsync(kvt_undo_dev(kv) + 2 * KVC_MAX_KV, 0, sizeof(int32_t) * KVC_MAX_KV, g.stream) != cudaSuccess)
        st = cuda_fail(cudaGetLastError(), "K/V undo state"); /* un = 0: the rows held went with the old room */
    if (st != KVC_OK) {
        stream_wait();
        kv->tabh = old;
        kvt_tab_put(kv);
        dfree(p, bytes, MEM_CACHE);
        return st;
    }
    if (kv->undo) dfree(kv->undo, kv->ubytes, MEM_CACHE);
    kv->undo = p;
    kv->ubytes = bytes;
    return KVC_OK;
}

/* ---- append and commit (graph-safe: lengths and nq from the device) ---- */

/* the rows at the device lengths; each head's mark (the length before this append) set and its undo rows dropped */
__global__ void stage_append_kernel(KvTab *__restrict__ tab, const bf16 *__restrict__ src, int64_t ld, int64_t kcol,
                                    int64_t vcol, int32_t d, const int32_t *__restrict__ len) {
    const int64_t i = blockIdx.x;
    const int h = blockIdx.y;
    if (i == 0 && threadIdx.x == 0) { /* no other block reads mark or un; the lengths move after this kernel */
        tab->mark[h] = len[h];
        tab->un[h] = 0;
    }
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
    KVC_TRY(kvt_stage_room(kv, need));
    if (kvt_kivi(kv)) KVC_TRY(undo_room(kv, kv->wait_max)); /* the rows of earlier calls a commit may quantise */
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

/* then, one block a head: KIVI keeps the encoded rows that waited before the last append as undo rows (the first
 * commit after it; kv_store.c's undo_keep), its rows left (fewer than a block) move to the front of the staging
 * rows (they do not overlap the rows moved from: fewer than `group` after at least `group`), and nq moves past the
 * rows encoded */
__global__ void commit_settle_kernel(const TypedRows t, KvTab *tab, const int32_t *__restrict__ len, int64_t limit) {
    const int h = blockIdx.x;
    const int64_t nq = tab->nq[h], c = (int64_t)len[h] - nq, m = commit_rows(t.f, c, limit);
    if (m <= 0) return; /* the whole block returns */
    float *st = tab->st[h];
    const int64_t d2 = 2 * (int64_t)t.d;
    int64_t pre = kvc_kv_type_key_blocks(t.f.type) ? kvc_kivi_undo_rows(tab->mark[h], nq, m, tab->un[h]) : 0;
    pre = pre <= tab->ucap ? pre : 0; /* never (undo_room sized them at the append): no write past the room */
    for (int64_t i = threadIdx.x; i < pre * d2; i += blockDim.x) tab->uk[h][i] = st[i];
    __syncthreads(); /* every thread has read un before it moves */
    for (int64_t i = threadIdx.x; i < (c - m) * d2; i += blockDim.x) st[i] = st[m * d2 + i];
    __syncthreads();
    if (threadIdx.x == 0) {
        tab->nq[h] = (int32_t)(nq + m);
        if (pre > 0) {
            tab->u0[h] = (int32_t)nq;
            tab->un[h] = (int32_t)pre;
        }
    }
}

kvc_status kvt_commit(kvc_kv *kv) {
    const int64_t limit = kvt_wait_limit(kv);
    const int cap = kvt_capturing();
    /* eagerly the host's bound says whether anything can go into the type; a capture records the kernels whatever
     * waits now, since its replays see other counts */
    if (!cap && (kv->wait_max <= 0 || kv->wait_max < limit)) return KVC_OK;
    const int32_t d = kv->d, per = kvt_kivi(kv) ? 8 / kvc_kv_type_bits(kv->fmt.type) : 1;
    const int64_t rows = kv->wait_max > limit ? kv->wait_max : limit;
    const int64_t items = rows + (kvt_kivi(kv) ? rows / kv->fmt.group * (d / per) : 0);
    const TypedRows t = typed_rows(kv);
    dim3 grid(kvt_blocks(items), (unsigned)kv->Hkv);
    commit_encode_kernel<<<grid, KVT_THREADS, 0, g.stream>>>(t, kv->lend, limit);
    LAUNCH_TRY("K/V commit");
    commit_settle_kernel<<<(unsigned)kv->Hkv, KVT_THREADS, 0, g.stream>>>(t, kv->tabd, kv->lend, limit);
    LAUNCH_TRY("K/V commit");
    /* what waits after: nothing (rows stored alone), fewer than limit rows (KIVI); after a capture the bound of
     * every replay */
    kv->wait_max = !kvt_kivi(kv) ? 0 : cap ? limit - 1 : kv->wait_max < limit - 1 ? kv->wait_max : limit - 1;
    /* a prefill's worth of staging rows goes once committed; a decode step's keep their room */
    if (!cap && kv->scap > kvt_stage_keep(kv)) {
        const int64_t keep = kv->wait_max > kvt_stage_keep(kv) ? kv->wait_max : kvt_stage_keep(kv);
        if (keep < kv->scap) return stage_resize(kv, keep, kv->wait_max);
    }
    return KVC_OK;
}

/* ---- the host's rows ---- */

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

kvc_status kvt_rows_to_staging(const kvc_kv *from, const RowList &L, float *const *st) {
    const int32_t Hkv = from->Hkv;
    if (L.off[Hkv] == 0) return KVC_OK;
    KVC_TRY(scratch(g_st_t, sizeof(float *) * (size_t)Hkv, "K/V staging table"));
    CU_TRY(h2d(g_st_t.p, st, sizeof(float *) * (size_t)Hkv), "K/V staging table");
    rows_out_kernel<<<kvt_blocks(L.off[Hkv] * (from->d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(from), L, Hkv, nullptr,
                                                                                          nullptr, 0, g_st_t.as<float *>());
    LAUNCH_TRY("K/V rows to f32 staging rows");
    CU_TRY(stream_wait(), "K/V rows to f32 staging rows"); /* st may be the caller's stack */
    return KVC_OK;
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

kvc_status kvt_list_put(const kvc_kv *kv, const int64_t *const *rows, const int64_t *n, const int32_t *inv, RowList *L,
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

kvc_status kvt_unquantise(kvc_kv *kv, const int64_t *r0, const int64_t *held, int64_t room, const kvc_kivi_cut *cut,
                          const int64_t *u0) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t cnt[KVC_MAX_KV], most = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        cnt[h] = held[h] > r0[h] ? held[h] - r0[h] : 0;
        most = cnt[h] > most ? cnt[h] : most;
    }
    int64_t rows = room > most ? room : most;
    rows = rows > kvt_stage_keep(kv) ? rows : kvt_stage_keep(kv);
    RowList L;
    KVC_TRY(kvt_list_put(kv, nullptr, cnt, nullptr, &L, nullptr));
    const size_t bytes = sizeof(float) * 2 * (size_t)d * (size_t)Hkv * (size_t)rows;
    float *p = nullptr;
    KVC_TRY(dalloc((void **)&p, bytes, MEM_CACHE, "K/V staging rows"));
    const KvTab old = kv->tabh;
    for (int32_t h = 0; h < Hkv; h++) {
        L.first[h] = r0[h];
        kv->tabh.st[h] = p + (size_t)h * rows * 2 * d;
    }
    kvc_status st = kvt_rows_to_staging(kv, L, kv->tabh.st); /* reads the old table: uploaded after */
    for (int32_t h = 0; h < Hkv && cut && st == KVC_OK; h++) /* a roll-back's rows: the undo rows, as they were */
        if (cut[h].ub > cut[h].ua &&
            cudaMemcpyAsync(kv->tabh.st[h] + (size_t)(cut[h].ua - r0[h]) * 2 * d, kv->tabh.uk[h] + (size_t)(cut[h].ua - u0[h]) * 2 * d,
                            sizeof(float) * 2 * (size_t)d * (size_t)(cut[h].ub - cut[h].ua), cudaMemcpyDeviceToDevice,
                            g.stream) != cudaSuccess)
            st = cuda_fail(cudaGetLastError(), "K/V undo rows");
    if (st == KVC_OK) st = kvt_tab_put(kv);
    if (st == KVC_OK) st = kvt_ints_put(kvt_nq_dev(kv), r0, Hkv, "K/V state");
    if (st != KVC_OK) {
        kv->tabh = old;
        kvt_tab_put(kv);
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

kvc_status kvt_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v, int commit) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t total = 0;
    for (int32_t h = 0; h < Hkv; h++) total += n[h];
    if (total == 0 || (!k && !v)) return KVC_OK;
    if (!kvt_kivi(kv)) {
        KVC_TRY(kvt_commit(kv)); /* then rows are written in the type wherever they lie */
    } else { /* KIVI: rows in f32 from the block of the lowest row written on; kv_commit quantises them again */
        int64_t held[KVC_MAX_KV], nq[KVC_MAX_KV], r0[KVC_MAX_KV], top[KVC_MAX_KV], low[KVC_MAX_KV], room = 0;
        int back = 0;
        KVC_TRY(kvt_state_get(kv, held, nq));
        for (int32_t h = 0; h < Hkv; h++) {
            int64_t lo = nq[h], hi = held[h];
            low[h] = n[h] > 0 ? idx[h][0] : -1;
            for (int64_t i = 0; i < n[h]; i++) {
                lo = idx[h][i] < lo ? idx[h][i] : lo;
                hi = idx[h][i] + 1 > hi ? idx[h][i] + 1 : hi;
                low[h] = idx[h][i] < low[h] ? idx[h][i] : low[h];
            }
            r0[h] = lo < nq[h] ? lo / kv->fmt.group * kv->fmt.group : nq[h];
            top[h] = hi;
            back |= r0[h] < nq[h];
            room = top[h] - r0[h] > room ? top[h] - r0[h] : room;
        }
        if (back) KVC_TRY(kvt_unquantise(kv, r0, held, room, nullptr, nullptr));
        KVC_TRY(kvt_stage_room(kv, room));
        for (int32_t h = 0; h < Hkv; h++) kv->wait_max = held[h] - r0[h] > kv->wait_max ? held[h] - r0[h] : kv->wait_max;
        /* a written head's undo rows go; rows written past the held ones are an append (RestoreKV's): its mark */
        int64_t mark[KVC_MAX_KV], u0[KVC_MAX_KV], un[KVC_MAX_KV], urows = 0;
        for (int32_t h = 0; h < Hkv; h++) /* undo rows can only be rows waiting below a mark: an append's */
            if (n[h] > 0 && kvc_kivi_write_mark(low[h], held[h]) >= 0 && held[h] - r0[h] > urows) urows = held[h] - r0[h];
        KVC_TRY(undo_room(kv, urows));
        KVC_TRY(kvt_undo_get(kv, mark, u0, un));
        for (int32_t h = 0; h < Hkv; h++)
            if (n[h] > 0) {
                mark[h] = kvc_kivi_write_mark(low[h], held[h]);
                un[h] = 0;
            }
        KVC_TRY(kvt_undo_set(kv, mark, un));
    }
    RowList L;
    KVC_TRY(kvt_list_put(kv, idx, n, nullptr, &L, nullptr));
    const int64_t vals = total * d, parts = (k != nullptr) + (v != nullptr);
    KVC_TRY(g_pin_t.need(sizeof(float) * (size_t)(vals * parts), "K/V write (pinned)"));
    KVC_TRY(scratch(g_rows_t, sizeof(float) * (size_t)(vals * parts), "K/V write rows"));
    if (k) memcpy(g_pin_t.p, k, sizeof(float) * (size_t)vals);
    if (v) memcpy(g_pin_t.as<float>() + (k ? vals : 0), v, sizeof(float) * (size_t)vals);
    CU_TRY(h2d(g_rows_t.p, g_pin_t.p, sizeof(float) * (size_t)(vals * parts)), "K/V write");
    const float *kd = k ? g_rows_t.as<float>() : nullptr, *vd = v ? g_rows_t.as<float>() + (k ? vals : 0) : nullptr;
    write_rows_kernel<<<kvt_blocks(total), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kd, vd);
    LAUNCH_TRY("K/V write");
    CU_TRY(stream_wait(), "K/V write");
    return commit && kvt_kivi(kv) ? kvt_commit(kv) : KVC_OK;
}

kvc_status kvt_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    RowList L;
    KVC_TRY(kvt_list_put(kv, nullptr, rows, nullptr, &L, nullptr));
    for (int32_t h = 0; h < Hkv; h++) L.first[h] = row0 ? row0[h] : 0;
    const int64_t total = L.off[Hkv], vals = total * d, parts = (k != nullptr) + (v != nullptr);
    if (total == 0 || parts == 0) return KVC_OK;
    KVC_TRY(scratch(g_rows_t, sizeof(float) * (size_t)(vals * parts), "K/V read staging"));
    KVC_TRY(g_pin_t.need(sizeof(float) * (size_t)(vals * parts), "K/V read (pinned)"));
    float *kd = k ? g_rows_t.as<float>() : nullptr, *vd = v ? g_rows_t.as<float>() + (k ? vals : 0) : nullptr;
    rows_out_kernel<<<kvt_blocks(total * (d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kd, vd, 0, nullptr);
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
    KVC_TRY(kvt_list_put(kv, nullptr, held, nullptr, &L, nullptr));
    const int64_t total = L.off[Hkv];
    KVC_TRY(scratch(g_exp_t, sizeof(bf16) * 2 * (size_t)(total > 0 ? total : 1) * d, "K/V rows for the scorers"));
    bf16 *kx = g_exp_t.as<bf16>(), *vx = kx + (size_t)total * d;
    for (int32_t h = 0; h < Hkv; h++) {
        k[h] = kx + (size_t)L.off[h] * d;
        v[h] = vx + (size_t)L.off[h] * d;
    }
    if (total == 0) return KVC_OK;
    rows_out_kernel<<<kvt_blocks(total * (d / 8)), KVT_THREADS, 0, g.stream>>>(typed_rows(kv), L, Hkv, kx, vx, 1, nullptr);
    LAUNCH_TRY("K/V rows for the scorers");
    return KVC_OK;
}

} // namespace kvc
