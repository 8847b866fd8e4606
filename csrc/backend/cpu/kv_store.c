/* The host K/V store (host.h's struct kvc_kv): one layer's ragged heads in the session's storage type
 * (core/kv_type.h), for the CPU backend and the emulated device.
 *
 * One arena per layer; per head [Kp: np rows of dk kept key channels][K][V], 64-byte aligned slices:
 *   rows stored alone (f32, f16, bf16, q8_0): Kp np x row(dk), K (cap - np) x row(d), V cap x row(d);
 *   KIVI (key blocks): K ceil(cap / group) blocks of `group` rows, V cap x row(d); ThinK's pruned rows
 *   keep the block's width with their dropped channels zero (a block cannot change width mid-way), so
 *   they cost what a full row costs and read back exact zeros there.
 * Rows [0, nq[h]) are in the type; rows [nq[h], len[h]) wait in f32 (the staging rows): those a layer
 * appended until its attention has read them (kv_commit), and KIVI's residual. A store whose type is
 * the rows' own (f32 on the CPU, bf16 on the emulated device) stores appended rows as they come.
 * The row rules (read and gather inside the rows held, write inside the capacity) are core/kv_layout.h's. */
#include <stdlib.h>
#include <string.h>

#include "../../core/kv_layout.h"
#include "../../core/kv_type.h"
#include "../../core/kv_undo.h"
#include "host.h"
#include "kv_decode.h"

#define KV_ALIGN 64
#define WMAX 1024 /* widest row a host store takes (checked at kv_new) */

static size_t align_up(size_t b) { return (b + KV_ALIGN - 1) & ~(size_t)(KV_ALIGN - 1); }
static int key_blocks(const kvc_kv *kv) { return kvc_kv_type_key_blocks(kv->fmt.type); }

/* A head's slices for cap rows, np of them pruned (narrow layouts only). */
static kvc_kv_slices head_slices(const kvc_kv *kv, int32_t dk, int64_t cap, int64_t np) {
    kvc_kv_slices s;
    const kvc_kv_format *f = &kv->fmt;
    if (key_blocks(kv)) np = 0;
    s.kp = 0;
    s.k = align_up((size_t)np * (dk > 0 ? kvc_kv_row_bytes(f, dk) : 0));
    s.v = s.k + align_up(kvc_kv_key_bytes(f, kv->d, cap - np));
    s.bytes = s.v + align_up((size_t)cap * kvc_kv_row_bytes(f, kv->d));
    return s;
}

static size_t arena_bytes(const kvc_kv *kv, int32_t dk, const int64_t *cap, const int64_t *np) {
    size_t b = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) b += head_slices(kv, dk, cap[h], np ? np[h] : 0).bytes;
    return b;
}

/* The row rule of core/kv_layout.h as a status. */
static kvc_status rows_check(kvc_kv_op op, const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const int64_t *keep,
                             int64_t held, int64_t cap) {
    char why[256];
    if (kvc_kv_rows_refused(op, h, kv->Hkv, row0, rows, keep, held, cap, why, sizeof why))
        return kvc_fail(KVC_ERR_INTERNAL, "%s", why);
    return KVC_OK;
}

size_t kvc_hkv_bytes(const kvc_kv *kv) { return kv->bytes + kv->sbytes; }

kvc_status kvc_hkv_new(kvc_host_stats *st, int32_t dtype, const kvc_kv_format *fmt, int32_t Hkv, int32_t d, kvc_kv **out) {
    *out = NULL;
    if (d > WMAX) return kvc_fail(KVC_ERR_UNSUPPORTED, "K/V store: head_dim %d is above %d", d, WMAX);
    kvc_kv_format f = {dtype == KVC_BF16 ? KVC_KV_BF16 : KVC_KV_F32, 0, 0};
    if (fmt && fmt->type != KVC_KV_NATIVE) f = *fmt;
    KVC_TRY(kvc_kv_format_check(&f, d));
    kvc_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    kv->Hkv = Hkv;
    kv->d = d;
    kv->dtype = dtype;
    kv->fmt = f;
    kv->direct = (dtype == KVC_F32 && f.type == KVC_KV_F32) || (dtype == KVC_BF16 && f.type == KVC_KV_BF16);
    kv->stats = st;
    kv->k = calloc((size_t)Hkv, sizeof *kv->k);
    kv->v = calloc((size_t)Hkv, sizeof *kv->v);
    kv->kp = calloc((size_t)Hkv, sizeof *kv->kp);
    kv->len = calloc((size_t)Hkv, sizeof *kv->len);
    kv->cap = calloc((size_t)Hkv, sizeof *kv->cap);
    kv->np = calloc((size_t)Hkv, sizeof *kv->np);
    kv->nq = calloc((size_t)Hkv, sizeof *kv->nq);
    kv->sk = calloc((size_t)Hkv, sizeof *kv->sk);
    kv->scap = calloc((size_t)Hkv, sizeof *kv->scap);
    kv->mark = calloc((size_t)Hkv * 3, sizeof *kv->mark);
    kv->uk = calloc((size_t)Hkv, sizeof *kv->uk);
    if (!kv->k || !kv->v || !kv->kp || !kv->len || !kv->cap || !kv->np || !kv->nq || !kv->sk || !kv->scap || !kv->mark ||
        !kv->uk) {
        kvc_hkv_free(kv);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    }
    kv->u0 = kv->mark + Hkv;
    kv->un = kv->mark + 2 * (size_t)Hkv;
    for (int32_t h = 0; h < Hkv; h++) kv->mark[h] = -1;
    *out = kv;
    return KVC_OK;
}

static void arena_release(kvc_kv *kv) {
    if (kv->arena) {
        kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, -(int64_t)kv->bytes);
        kvc_free(kv->arena);
    }
    kv->arena = NULL;
    kv->bytes = 0;
}

/* ---- the staging rows: per head [scap, 2d] f32 (K row then V row), rows [nq, len) at 0 .. ---- */

static float *staged(const kvc_kv *kv, int32_t h, int64_t r) { return kv->sk[h] + (size_t)(r - kv->nq[h]) * 2 * kv->d; }

/* Room for `rows` staging rows in head h (grown by half again; shrunk to fit when asked: shrink). */
static kvc_status staging_room(kvc_kv *kv, int32_t h, int64_t rows, int shrink) {
    const int64_t want = shrink ? rows : rows <= kv->scap[h] ? kv->scap[h] : rows + rows / 2;
    if (want == kv->scap[h]) return KVC_OK;
    float *p = NULL;
    const size_t row = sizeof(float) * 2 * (size_t)kv->d;
    if (want > 0) {
        p = kvc_malloc(row * (size_t)want, "K/V staging rows");
        if (!p) return KVC_ERR_NOMEM;
        const int64_t keep = kv->len[h] - kv->nq[h] < want ? kv->len[h] - kv->nq[h] : want;
        if (keep > 0) memcpy(p, kv->sk[h], row * (size_t)keep);
    }
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, (int64_t)(row * (size_t)want) - (int64_t)(row * (size_t)kv->scap[h]));
    kv->sbytes = kv->sbytes + row * (size_t)want - row * (size_t)kv->scap[h];
    kvc_free(kv->sk[h]);
    kv->sk[h] = p;
    kv->scap[h] = want;
    return KVC_OK;
}

/* ---- KIVI's undo rows (host.h; the rule is core/kv_undo.h's): what a roll-back to the length before the last
 * append needs ---- */

static void undo_drop(kvc_kv *kv, int32_t h) {
    if (kv->un[h] == 0) return;
    const size_t b = sizeof(float) * 2 * (size_t)kv->d * (size_t)kv->un[h];
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, -(int64_t)b);
    kv->sbytes -= b;
    kvc_free(kv->uk[h]);
    kv->uk[h] = NULL;
    kv->un[h] = 0;
}

/* The rows move otherwise than by an append and its commit: no roll-back to the last append's length. */
static void undo_forget(kvc_kv *kv) {
    for (int32_t h = 0; h < kv->Hkv; h++) {
        undo_drop(kv, h);
        kv->mark[h] = -1;
    }
}

/* Before commit_head quantises rows [nq, nq + m) of head h: a copy of those of them that waited before the
 * last append (the rows of earlier calls; fewer than max(residual, group)). */
static kvc_status undo_keep(kvc_kv *kv, int32_t h, int64_t m) {
    const int64_t pre = kvc_kivi_undo_rows(kv->mark[h], kv->nq[h], m, kv->un[h]);
    if (pre == 0) return KVC_OK;
    const size_t b = sizeof(float) * 2 * (size_t)kv->d * (size_t)pre;
    kv->uk[h] = kvc_malloc(b, "K/V undo rows");
    if (!kv->uk[h]) return KVC_ERR_NOMEM;
    memcpy(kv->uk[h], kv->sk[h], b);
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, (int64_t)b);
    kv->sbytes += b;
    kv->u0[h] = kv->nq[h];
    kv->un[h] = pre;
    return KVC_OK;
}

void kvc_hkv_free(kvc_kv *kv) {
    if (!kv) return;
    arena_release(kv);
    if (kv->sk)
        for (int32_t h = 0; h < kv->Hkv; h++) kvc_free(kv->sk[h]);
    if (kv->uk)
        for (int32_t h = 0; h < kv->Hkv; h++) kvc_free(kv->uk[h]);
    if (kv->stats && kv->sbytes) kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, -(int64_t)kv->sbytes);
    free(kv->k);
    free(kv->v);
    free(kv->kp);
    free(kv->len);
    free(kv->cap);
    free(kv->np);
    free(kv->nq);
    free(kv->sk);
    free(kv->scap);
    free(kv->mark);
    free(kv->uk);
    free(kv->kidx);
    free(kv);
}

/* ---- a layout being built: the arena and its slices, the pruned rows and channels it will have ---- */
typedef struct layout {
    void *arena;
    size_t bytes;
    void **k, **v, **kp;
    int64_t *np;
    int32_t dk;
    int32_t *kidx; /* owned until adopted */
} layout;

static void layout_drop(layout *L) {
    kvc_free(L->arena);
    free(L->k); /* v and kp point into the same array */
    free(L->np);
    free(L->kidx);
    memset(L, 0, sizeof *L);
}

/* L->np, dk and kidx set: allocate the arena for cap[h] rows per head and point the slices into it. */
static kvc_status layout_alloc(const kvc_kv *kv, const int64_t *cap, layout *L) {
    L->bytes = arena_bytes(kv, L->dk, cap, L->np);
    if (L->bytes == 0) return KVC_OK;
    L->arena = kvc_malloc_huge(L->bytes, "KV cache");
    if (!L->arena) return KVC_ERR_NOMEM;
    char *p = L->arena;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const kvc_kv_slices s = head_slices(kv, L->dk, cap[h], L->np[h]);
        L->kp[h] = p + s.kp;
        L->k[h] = p + s.k;
        L->v[h] = p + s.v;
        p += s.bytes;
    }
    return KVC_OK;
}

/* Start a layout with dk kept channels (kidx [Hkv dk], copied; dk 0: none). */
static kvc_status layout_new(const kvc_kv *kv, int32_t dk, const int32_t *kidx, layout *L) {
    memset(L, 0, sizeof *L);
    const size_t H = (size_t)kv->Hkv;
    L->k = calloc(3 * H, sizeof *L->k);
    L->np = calloc(H, sizeof *L->np);
    L->dk = dk;
    if (dk > 0) L->kidx = malloc(sizeof(int32_t) * H * (size_t)dk);
    if (!L->k || !L->np || (dk > 0 && !L->kidx)) {
        layout_drop(L);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    }
    L->v = L->k + H;
    L->kp = L->k + 2 * H;
    if (dk > 0) memcpy(L->kidx, kidx, sizeof(int32_t) * H * (size_t)dk);
    return KVC_OK;
}

static void layout_adopt(kvc_kv *kv, layout *L, const int64_t *cap, const int64_t *len) {
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, (int64_t)L->bytes); /* before the old one goes: the peak sees both */
    arena_release(kv);
    kv->arena = L->arena;
    kv->bytes = L->bytes;
    int64_t pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        kv->k[h] = L->k[h];
        kv->v[h] = L->v[h];
        kv->kp[h] = L->np[h] > 0 && !key_blocks(kv) ? L->kp[h] : NULL;
        kv->np[h] = L->np[h];
        kv->cap[h] = cap[h];
        kv->len[h] = len[h];
        pruned += L->np[h];
    }
    free(kv->kidx);
    kv->dk = pruned > 0 ? L->dk : 0; /* no pruned row left: the plain layout again */
    kv->kidx = pruned > 0 ? L->kidx : NULL;
    if (pruned == 0) free(L->kidx);
    L->arena = NULL;
    L->kidx = NULL;
    layout_drop(L);
}

/* ---- typed rows (rows < nq) ---- */

static size_t vrow_bytes(const kvc_kv *kv) { return kvc_kv_row_bytes(&kv->fmt, kv->d); }

/* Zero the channels a pruned key row dropped (dk kept channels ix). */
static void mask_dropped(float *row, int32_t d, int32_t dk, const int32_t *ix) {
    int32_t j = 0;
    for (int32_t c = 0; c < d; c++) {
        if (j < dk && ix[j] == c) {
            j++;
            continue;
        }
        row[c] = 0.f;
    }
}

/* Typed key rows [r0, r0 + n) (< nq, one side of np on narrow layouts) of head h into out: [n, dk] for
 * narrow pruned rows, else [n, d] (key blocks: pruned rows with zeros in their dropped channels). */
static void keys_typed(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *out) {
    const kvc_kv_format *f = &kv->fmt;
    const int32_t d = kv->d;
    if (key_blocks(kv)) {
        const int32_t G = f->group;
        const size_t bb = kvc_kivi_block_bytes(f, d);
        for (int64_t r = r0; r < r0 + n;) {
            const int64_t b = r / G, in = r - b * G, m = r0 + n - r < G - in ? r0 + n - r : G - in;
            kvc_cpu_kivi_decode_block(f, (const char *)kv->k[h] + (size_t)b * bb, d, (int32_t)in, (int32_t)m,
                                      out + (size_t)(r - r0) * d);
            r += m;
        }
        if (kv->dk > 0)
            for (int64_t r = r0; r < r0 + n && r < kv->np[h]; r++)
                mask_dropped(out + (size_t)(r - r0) * d, d, kv->dk, kv->kidx + (size_t)h * kv->dk);
        return;
    }
    if (r0 < kv->np[h]) {
        const size_t rb = kvc_kv_row_bytes(f, kv->dk);
        kvc_cpu_kv_decode_rows(f, (const char *)kv->kp[h] + (size_t)r0 * rb, rb, n, kv->dk, out);
        return;
    }
    const size_t rb = kvc_kv_row_bytes(f, d);
    kvc_cpu_kv_decode_rows(f, (const char *)kv->k[h] + (size_t)kvc_kv_full_row(r0, kv->np[h]) * rb, rb, n, d, out);
}

static void values_typed(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *out) {
    const size_t rb = vrow_bytes(kv);
    kvc_cpu_kv_decode_rows(&kv->fmt, (const char *)kv->v[h] + (size_t)r0 * rb, rb, n, kv->d, out);
}

/* Key row r of head h as d f32 channels (a pruned row: zeros in the dropped channels). */
static void key_get(const kvc_kv *kv, int32_t h, int64_t r, float *out) {
    const int32_t d = kv->d;
    if (r >= kv->nq[h]) {
        memcpy(out, staged(kv, h, r), sizeof(float) * (size_t)d);
        return;
    }
    if (key_blocks(kv) || r >= kv->np[h]) {
        keys_typed(kv, h, r, 1, out);
        return;
    }
    float tmp[WMAX];
    const int32_t dk = kv->dk, *ix = kv->kidx + (size_t)h * dk;
    keys_typed(kv, h, r, 1, tmp);
    memset(out, 0, sizeof(float) * (size_t)d);
    for (int32_t j = 0; j < dk; j++) out[ix[j]] = tmp[j];
}

static void value_get(const kvc_kv *kv, int32_t h, int64_t r, float *out) {
    if (r >= kv->nq[h])
        memcpy(out, staged(kv, h, r) + kv->d, sizeof(float) * (size_t)kv->d);
    else
        values_typed(kv, h, r, 1, out);
}

/* Store the d-channel key row `row` as typed row r of head h of layout L (rows stored alone: a pruned row
 * keeps its channels). */
static void key_put(const kvc_kv *kv, const layout *L, int32_t h, int64_t r, const float *row) {
    const kvc_kv_format *f = &kv->fmt;
    if (r >= L->np[h]) {
        kvc_cpu_kv_encode_row(f, row, kv->d, (char *)L->k[h] + (size_t)kvc_kv_full_row(r, L->np[h]) * kvc_kv_row_bytes(f, kv->d));
        return;
    }
    float tmp[WMAX];
    const int32_t dk = L->dk, *ix = L->kidx + (size_t)h * dk;
    for (int32_t j = 0; j < dk; j++) tmp[j] = row[ix[j]];
    kvc_cpu_kv_encode_row(f, tmp, dk, (char *)L->kp[h] + (size_t)r * kvc_kv_row_bytes(f, dk));
}

static void value_put(const kvc_kv *kv, void *vh, int64_t r, const float *row) {
    kvc_cpu_kv_encode_row(&kv->fmt, row, kv->d, (char *)vh + (size_t)r * vrow_bytes(kv));
}

/* KIVI: rows [r0, r0 + G) of head h (K from the staging rows, or krows [G, d]) become key block r0 / G. */
static void block_put(const kvc_kv *kv, void *kh, int64_t r0, const float *krows) {
    kvc_kivi_encode_block(&kv->fmt, krows, kv->d, (char *)kh + (size_t)(r0 / kv->fmt.group) * kvc_kivi_block_bytes(&kv->fmt, kv->d));
}

/* ---- commit: staging rows into the type ---- */

/* Rows stored alone: every staging row of head h into the arena (its rows [nq, len) have room). KIVI: when
 * `residual` rows or more wait (at least a block), every whole block of them. */
static kvc_status commit_head(kvc_kv *kv, int32_t h) {
    const int32_t d = kv->d;
    const int64_t c = kv->len[h] - kv->nq[h];
    if (c <= 0) return KVC_OK;
    const layout self = {.k = kv->k, .v = kv->v, .kp = kv->kp, .np = kv->np, .dk = kv->dk, .kidx = kv->kidx};
    int64_t m = c;
    if (key_blocks(kv)) {
        const int64_t G = kv->fmt.group, R = kv->fmt.residual;
        if (c < (R > G ? R : G)) return KVC_OK;
        m = c / G * G;
        KVC_TRY(undo_keep(kv, h, m));
        float kb[64 * WMAX / 16]; /* G rows of K gathered from the staging rows (G d <= 4096 here, else heap) */
        float *blk = (size_t)G * d <= sizeof kb / sizeof kb[0] ? kb : kvc_malloc(sizeof(float) * (size_t)G * d, "KIVI block");
        if (!blk) return KVC_ERR_NOMEM;
        for (int64_t b = 0; b < m; b += G) {
            for (int64_t i = 0; i < G; i++) memcpy(blk + i * d, kv->sk[h] + (size_t)(b + i) * 2 * d, sizeof(float) * (size_t)d);
            block_put(kv, kv->k[h], kv->nq[h] + b, blk);
        }
        if (blk != kb) kvc_free(blk);
    } else {
        for (int64_t i = 0; i < m; i++) key_put(kv, &self, h, kv->nq[h] + i, kv->sk[h] + (size_t)i * 2 * d);
    }
    for (int64_t i = 0; i < m; i++) value_put(kv, kv->v[h], kv->nq[h] + i, kv->sk[h] + (size_t)i * 2 * d + d);
    memmove(kv->sk[h], kv->sk[h] + (size_t)m * 2 * d, sizeof(float) * 2 * (size_t)d * (size_t)(c - m));
    kv->nq[h] += m;
    /* a prefill's worth of staging goes once committed; a decode step's few rows keep their room */
    const int64_t keep = key_blocks(kv) ? (kv->fmt.residual > kv->fmt.group ? kv->fmt.residual : kv->fmt.group) + 8 : 8;
    if (kv->scap[h] > keep) return staging_room(kv, h, c - m > keep ? c - m : keep, 1);
    return KVC_OK;
}

kvc_status kvc_hkv_commit(kvc_kv *kv) {
    if (kv->direct) return KVC_OK;
    for (int32_t h = 0; h < kv->Hkv; h++) KVC_TRY(commit_head(kv, h));
    return KVC_OK;
}

/* Rows stored alone: every staging row into the type now (before a change of layout or a write). */
static kvc_status commit_all(kvc_kv *kv) {
    if (kv->direct || key_blocks(kv)) return KVC_OK;
    return kvc_hkv_commit(kv);
}

/* ---- rebuilds ---- */

/* kv's new arena (layout L: its np and channels set) of cap[h] rows per head holds, per head, rows
 * [0, n[h]) of from (keep NULL) or the rows keep[h][0 .. n[h]) of from; the old arena goes. Rows stored
 * alone whose key layout stays are copied as stored, the others pass through f32 (exact for f32, f16 and
 * bf16; q8_0 and KIVI codes of a decoded row are its codes again, up to the f16 rounding of the scale).
 * KIVI: whole key blocks a prefix keeps are copied; every other kept row waits in f32 (then the residual
 * rule of kv_commit applies), as transformers' QuantizedCache quantises again what a press keeps. */
static kvc_status rebuild(kvc_kv *kv, kvc_kv *from, const int64_t *cap, const int64_t *const *keep, const int64_t *n,
                          layout *L) {
    KVC_TRY(commit_all(from));
    undo_forget(kv);
    if (layout_alloc(kv, cap, L) != KVC_OK) {
        layout_drop(L);
        return KVC_ERR_NOMEM;
    }
    const int32_t d = kv->d, Hkv = kv->Hkv;
    const size_t vb = vrow_bytes(kv);
    int64_t *nq = malloc(sizeof(int64_t) * (size_t)Hkv);
    float **sk = calloc((size_t)Hkv, sizeof *sk);
    int64_t *scap = calloc((size_t)Hkv, sizeof *scap);
    kvc_status st = !nq || !sk || !scap ? kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store") : KVC_OK;
    float row[2 * WMAX];
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (key_blocks(kv)) {
            const int64_t G = kv->fmt.group;
            /* whole blocks of a prefix are copied as stored */
            int64_t whole = keep ? 0 : (n[h] < from->nq[h] ? n[h] : from->nq[h]) / G * G;
            if (whole > 0) {
                memcpy(L->k[h], from->k[h], (size_t)(whole / G) * kvc_kivi_block_bytes(&kv->fmt, d));
                memcpy(L->v[h], from->v[h], (size_t)whole * vb);
            }
            nq[h] = whole;
            scap[h] = n[h] - whole;
            if (scap[h] > 0) {
                sk[h] = kvc_malloc(sizeof(float) * 2 * (size_t)d * (size_t)scap[h], "K/V staging rows");
                if (!sk[h]) {
                    st = KVC_ERR_NOMEM;
                    break;
                }
                for (int64_t i = whole; i < n[h]; i++) {
                    const int64_t s = keep ? keep[h][i] : i;
                    key_get(from, h, s, sk[h] + (size_t)(i - whole) * 2 * d);
                    value_get(from, h, s, sk[h] + (size_t)(i - whole) * 2 * d + d);
                }
            }
            continue;
        }
        const int same_ch = from->dk == L->dk &&
                            (L->dk == 0 || !memcmp(from->kidx + (size_t)h * L->dk, L->kidx + (size_t)h * L->dk,
                                                   sizeof(int32_t) * (size_t)L->dk));
        const size_t kb = kvc_kv_row_bytes(&kv->fmt, d), kpb = L->dk > 0 ? kvc_kv_row_bytes(&kv->fmt, L->dk) : 0;
        for (int64_t i = 0; i < n[h]; i++) {
            const int64_t s = keep ? keep[h][i] : i;
            memcpy((char *)L->v[h] + (size_t)i * vb, (const char *)from->v[h] + (size_t)s * vb, vb);
            const int sp = s < from->np[h], dp = i < L->np[h];
            if (!sp && !dp)
                memcpy((char *)L->k[h] + (size_t)(i - L->np[h]) * kb, (const char *)from->k[h] + (size_t)(s - from->np[h]) * kb, kb);
            else if (sp && dp && same_ch)
                memcpy((char *)L->kp[h] + (size_t)i * kpb, (const char *)from->kp[h] + (size_t)s * kpb, kpb);
            else {
                key_get(from, h, s, row);
                key_put(kv, L, h, i, row);
            }
        }
        nq[h] = n[h];
    }
    if (st != KVC_OK) {
        for (int32_t h = 0; sk && h < Hkv; h++) kvc_free(sk[h]);
        layout_drop(L);
        free(nq);
        free(sk);
        free(scap);
        return st;
    }
    /* the new staging rows replace the old */
    for (int32_t h = 0; h < Hkv; h++) {
        kvc_free(kv->sk[h]);
        kv->sk[h] = sk[h];
        kv->scap[h] = scap[h];
        kv->nq[h] = nq[h];
    }
    size_t sb = 0;
    for (int32_t h = 0; h < Hkv; h++) sb += sizeof(float) * 2 * (size_t)d * (size_t)scap[h];
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, (int64_t)sb - (int64_t)kv->sbytes);
    kv->sbytes = sb;
    free(nq);
    free(sk);
    free(scap);
    layout_adopt(kv, L, cap, n);
    return key_blocks(kv) ? kvc_hkv_commit(kv) : KVC_OK;
}

/* rebuild from a store other than kv (a copy of a cache) reads `from` only; its staging stays its own */
kvc_status kvc_hkv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src) {
    kvc_kv *from = src ? (kvc_kv *)src : kv;
    if (src && (src->fmt.type != kv->fmt.type || src->fmt.group != kv->fmt.group || src->d != kv->d))
        return kvc_fail(KVC_ERR_INTERNAL, "K/V resize: the source store has another type");
    for (int32_t h = 0; h < kv->Hkv; h++) KVC_TRY(rows_check(KVC_KV_RESIZE, kv, h, 0, rows[h], NULL, from->len[h], cap[h]));
    layout L;
    KVC_TRY(layout_new(kv, from->dk, from->kidx, &L)); /* the pruned prefix goes along */
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kvc_kv_resized_pruned(rows[h], from->np[h]);
    return rebuild(kv, from, cap, NULL, rows, &L);
}

kvc_status kvc_hkv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        KVC_TRY(rows_check(KVC_KV_GATHER, kv, h, 0, n_keep[h], keep[h], kv->len[h], cap[h]));
    layout L;
    KVC_TRY(layout_new(kv, kv->dk, kv->kidx, &L));
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kvc_kv_gathered_pruned(keep[h], n_keep[h], kv->np[h]);
    return rebuild(kv, kv, cap, keep, n_keep, &L);
}

/* KIVI: a pruned key row keeps the block's width; its dropped channels become exact zeros: in a block whose
 * rows are all pruned, the dropped channels' scale and min are set to 0 (no other value moves), in the
 * staging rows the values. */
static kvc_status prune_blocks(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    int32_t *ix = malloc(sizeof(int32_t) * (size_t)kv->Hkv * (size_t)dk);
    if (!ix) return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V prune");
    memcpy(ix, kidx, sizeof(int32_t) * (size_t)kv->Hkv * (size_t)dk);
    undo_forget(kv);
    const int32_t d = kv->d;
    const size_t bb = kvc_kivi_block_bytes(&kv->fmt, d);
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const int32_t *hx = ix + (size_t)h * dk;
        for (int64_t b = 0; b < kv->nq[h] / kv->fmt.group; b++) {
            uint16_t *par = (uint16_t *)((char *)kv->k[h] + (size_t)b * bb);
            int32_t j = 0;
            for (int32_t c = 0; c < d; c++) {
                if (j < dk && hx[j] == c) {
                    j++;
                    continue;
                }
                par[c] = 0;
                par[d + c] = 0;
            }
        }
        for (int64_t r = kv->nq[h]; r < kv->len[h]; r++) mask_dropped(staged(kv, h, r), d, dk, hx);
        kv->np[h] = kv->len[h];
    }
    free(kv->kidx);
    kv->kidx = ix;
    kv->dk = dk;
    return KVC_OK;
}

kvc_status kvc_hkv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    if (dk < 1 || dk > kv->d) return kvc_fail(KVC_ERR_INTERNAL, "K/V prune: %d kept channels of %d", dk, kv->d);
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int32_t j = 0; j < dk; j++) {
            const int32_t c = kidx[(size_t)h * dk + j];
            if (c < 0 || c >= kv->d || (j > 0 && c <= kidx[(size_t)h * dk + j - 1]))
                return kvc_fail(KVC_ERR_INTERNAL, "K/V prune: head %d channels are not increasing inside [0, %d)", h, kv->d);
        }
    if (key_blocks(kv)) return prune_blocks(kv, dk, kidx); /* channels dropped before are zeros already */
    KVC_TRY(commit_all(kv));
    layout L;
    KVC_TRY(layout_new(kv, dk, kidx, &L));
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kv->len[h];
    int64_t *cap = malloc(sizeof(int64_t) * (size_t)kv->Hkv), *len = malloc(sizeof(int64_t) * (size_t)kv->Hkv);
    kvc_status st = (!cap || !len) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V prune") : KVC_OK;
    if (st == KVC_OK) {
        memcpy(cap, kv->cap, sizeof(int64_t) * (size_t)kv->Hkv);
        memcpy(len, kv->len, sizeof(int64_t) * (size_t)kv->Hkv);
        st = rebuild(kv, kv, cap, NULL, len, &L);
    } else {
        layout_drop(&L);
    }
    free(cap);
    free(len);
    return st;
}

/* KIVI: rows [r0, nq) of head h (r0 a block's start) back to staging rows, so writes and cuts below nq see
 * rows in f32: decoded, rows [ua, ub) (a roll-back's) the undo rows as they were. */
static kvc_status unquantise_from(kvc_kv *kv, int32_t h, int64_t r0, int64_t ua, int64_t ub) {
    const int64_t back = kv->nq[h] - r0, waiting = kv->len[h] - kv->nq[h];
    if (back <= 0) return KVC_OK;
    KVC_TRY(staging_room(kv, h, back + (waiting > 0 ? waiting : 0), 0));
    const int32_t d = kv->d;
    float *tmp = kvc_malloc(sizeof(float) * (size_t)back * d, "K/V rows"); /* before anything moves */
    if (!tmp) return KVC_ERR_NOMEM;
    if (waiting > 0) memmove(kv->sk[h] + (size_t)back * 2 * d, kv->sk[h], sizeof(float) * 2 * (size_t)d * (size_t)waiting);
    keys_typed(kv, h, r0, back, tmp);
    for (int64_t i = 0; i < back; i++) {
        memcpy(kv->sk[h] + (size_t)i * 2 * d, tmp + (size_t)i * d, sizeof(float) * (size_t)d);
        values_typed(kv, h, r0 + i, 1, kv->sk[h] + (size_t)i * 2 * d + d);
    }
    for (int64_t r = ua; r < ub; r++)
        memcpy(kv->sk[h] + (size_t)(r - r0) * 2 * d, kv->uk[h] + (size_t)(r - kv->u0[h]) * 2 * d, sizeof(float) * 2 * (size_t)d);
    kvc_free(tmp);
    kv->nq[h] = r0;
    return KVC_OK;
}

kvc_status kvc_hkv_set_lens(kvc_kv *kv, const int64_t *len) {
    int into_pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        if (len[h] < 0 || len[h] > kv->cap[h])
            return kvc_fail(KVC_ERR_INTERNAL, "K/V lengths: head %d gets %lld rows of %lld", h, (long long)len[h],
                            (long long)kv->cap[h]);
        into_pruned |= len[h] < kv->np[h];
    }
    KVC_TRY(commit_all(kv));
    if (into_pruned && !key_blocks(kv)) { /* the pruned prefix shrinks: later rows are full again, so the arena is rebuilt */
        int64_t *cap = malloc(sizeof(int64_t) * (size_t)kv->Hkv);
        if (!cap) return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V lengths");
        memcpy(cap, kv->cap, sizeof(int64_t) * (size_t)kv->Hkv);
        const kvc_status st = kvc_hkv_resize(kv, cap, len, NULL);
        free(cap);
        return st;
    }
    for (int32_t h = 0; h < kv->Hkv; h++) {
        if (key_blocks(kv)) {
            const kvc_kivi_cut cut =
                kvc_kivi_cut_to(len[h], kv->len[h], kv->nq[h], kv->fmt.group, kv->mark[h], kv->u0[h], kv->un[h]);
            if (cut.r0 < kv->nq[h]) KVC_TRY(unquantise_from(kv, h, cut.r0, cut.ua, cut.ub));
            if (!cut.keep) {
                undo_drop(kv, h);
                kv->mark[h] = -1;
            }
            if (len[h] > kv->nq[h]) KVC_TRY(staging_room(kv, h, len[h] - kv->nq[h], 0));
            if (len[h] < kv->np[h]) kv->np[h] = len[h];
        } else {
            kv->nq[h] = len[h]; /* rows stored alone: rows past the old length were written typed (kv_write) */
        }
        kv->len[h] = len[h];
    }
    int64_t pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) pruned += kv->np[h];
    if (pruned == 0 && kv->dk > 0) {
        free(kv->kidx);
        kv->kidx = NULL;
        kv->dk = 0;
    }
    return KVC_OK;
}

kvc_status kvc_hkv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v) {
    KVC_TRY(rows_check(KVC_KV_WRITE, kv, h, row0, rows, NULL, 0, h >= 0 && h < kv->Hkv ? kv->cap[h] : 0));
    KVC_TRY(commit_all(kv));
    const int32_t d = kv->d;
    if (key_blocks(kv)) { /* rows in f32 from the block of row0 on, written there; kv_commit quantises them again */
        if (row0 < kv->nq[h]) KVC_TRY(unquantise_from(kv, h, row0 / kv->fmt.group * kv->fmt.group, 0, 0));
        undo_drop(kv, h); /* rows written past the held ones are an append (RestoreKV's): a roll-back cuts them */
        kv->mark[h] = kvc_kivi_write_mark(row0, kv->len[h]);
        const int64_t top = row0 + rows > kv->len[h] ? row0 + rows : kv->len[h];
        KVC_TRY(staging_room(kv, h, top - kv->nq[h], 0));
        for (int64_t r = 0; r < rows; r++) {
            float *s = staged(kv, h, row0 + r);
            if (k) {
                memcpy(s, k + r * d, sizeof(float) * (size_t)d);
                if (row0 + r < kv->np[h]) mask_dropped(s, d, kv->dk, kv->kidx + (size_t)h * kv->dk);
            }
            if (v) memcpy(s + d, v + r * d, sizeof(float) * (size_t)d);
        }
        return KVC_OK;
    }
    const layout self = {.k = kv->k, .v = kv->v, .kp = kv->kp, .np = kv->np, .dk = kv->dk, .kidx = kv->kidx};
    for (int64_t r = 0; r < rows; r++) {
        if (k) key_put(kv, &self, h, row0 + r, k + r * d); /* a pruned row keeps its channels only */
        if (v) value_put(kv, kv->v[h], row0 + r, v + r * d);
    }
    return KVC_OK;
}

kvc_status kvc_hkv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v) {
    KVC_TRY(rows_check(KVC_KV_READ, kv, h, row0, rows, NULL, h >= 0 && h < kv->Hkv ? kv->len[h] : 0, 0));
    for (int64_t r = 0; r < rows; r++) {
        if (k) key_get(kv, h, row0 + r, k + r * kv->d);
        if (v) value_get(kv, h, row0 + r, v + r * kv->d);
    }
    return KVC_OK;
}

/* The batched entries of the table: checked whole before anything moves, so a refused call changes nothing. */
kvc_status kvc_hkv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        KVC_TRY(rows_check(KVC_KV_READ, kv, h, row0 ? row0[h] : 0, rows[h], NULL, kv->len[h], 0));
    size_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        KVC_TRY(kvc_hkv_read(kv, h, row0 ? row0[h] : 0, rows[h], k ? k + off : NULL, v ? v + off : NULL));
        off += (size_t)rows[h] * kv->d;
    }
    return KVC_OK;
}

kvc_status kvc_hkv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int64_t i = 0; i < n[h]; i++) KVC_TRY(rows_check(KVC_KV_WRITE, kv, h, idx[h][i], 1, NULL, 0, kv->cap[h]));
    size_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int64_t i = 0; i < n[h]; i++, off += (size_t)kv->d)
            KVC_TRY(kvc_hkv_write(kv, h, idx[h][i], 1, k ? k + off : NULL, v ? v + off : NULL));
    if (!key_blocks(kv)) return KVC_OK;
    for (int32_t h = 0; h < kv->Hkv; h++) { /* the rows written together are one write: its mark is its lowest row's */
        int64_t lo = n[h] > 0 ? idx[h][0] : -1;
        for (int64_t i = 1; i < n[h]; i++) lo = idx[h][i] < lo ? idx[h][i] : lo;
        if (lo >= 0) kv->mark[h] = kvc_kivi_write_mark(lo, kv->len[h]);
    }
    return kvc_hkv_commit(kv);
}

kvc_status kvc_hkv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    for (int32_t h = 0; h < Hkv; h++)
        if (kv->len[h] + n > kv->cap[h])
            return kvc_fail(KVC_ERR_INTERNAL, "K/V append: head %d has room for %lld rows, not %lld more", h,
                            (long long)(kv->cap[h] - kv->len[h]), (long long)n);
    if (src.buf->dtype != kv->dtype)
        return kvc_fail(KVC_ERR_INTERNAL, "K/V append: rows of dtype %d into a store of dtype %d", src.buf->dtype, kv->dtype);
    const size_t es = kvc_dtype_size(kv->dtype);
    if (kv->direct) {
        for (int32_t h = 0; h < Hkv; h++) /* appended rows are full (len >= np: set_lens keeps it so) */
            for (int64_t i = 0; i < n; i++) {
                memcpy((char *)kv->k[h] + (size_t)kvc_kv_full_row(kv->len[h] + i, kv->np[h]) * d * es,
                       kvc_hbuf_at(src, i, kcol + (int64_t)h * d), (size_t)d * es);
                memcpy((char *)kv->v[h] + (size_t)(kv->len[h] + i) * d * es, kvc_hbuf_at(src, i, vcol + (int64_t)h * d),
                       (size_t)d * es);
            }
        for (int32_t h = 0; h < Hkv; h++) kv->len[h] += n, kv->nq[h] = kv->len[h];
        return KVC_OK;
    }
    for (int32_t h = 0; h < Hkv; h++) KVC_TRY(staging_room(kv, h, kv->len[h] - kv->nq[h] + n, 0));
    for (int32_t h = 0; h < Hkv; h++) { /* a new call's rows: the last one's undo rows go */
        undo_drop(kv, h);
        kv->mark[h] = kv->len[h];
    }
    for (int32_t h = 0; h < Hkv; h++) {
        for (int64_t i = 0; i < n; i++) {
            float *s = kv->sk[h] + (size_t)(kv->len[h] + i - kv->nq[h]) * 2 * d;
            const void *ks = kvc_hbuf_at(src, i, kcol + (int64_t)h * d), *vs = kvc_hbuf_at(src, i, vcol + (int64_t)h * d);
            if (kv->dtype == KVC_BF16)
                for (int32_t e = 0; e < d; e++)
                    s[e] = kvc_bf16_to_f32v(((const uint16_t *)ks)[e]), s[d + e] = kvc_bf16_to_f32v(((const uint16_t *)vs)[e]);
            else {
                memcpy(s, ks, sizeof(float) * (size_t)d);
                memcpy(s + d, vs, sizeof(float) * (size_t)d);
            }
        }
        kv->len[h] += n;
    }
    return KVC_OK;
}

/* ---- f32 rows for the kernels ---- */

/* Rows [r0, r0 + n) of head h, keys (want_v 0) or values, as f32, *ld floats apart: in place where they are
 * f32 in memory (the type's rows of an f32 store; rows all waiting in f32, a key row and its value row
 * interleaved: a prefill reads its own rows there), else decoded into buf. Keys of narrow pruned rows
 * come [n, dk] (the range lies on one side of np: the attention's tiles never straddle it). */
static const float *rows_f32(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, int want_v, float *buf, int64_t *ld) {
    const int32_t d = kv->d;
    const int64_t nq = kv->nq[h], e = r0 + n;
    const int narrow = !want_v && !key_blocks(kv) && r0 < kv->np[h];
    *ld = narrow ? kv->dk : d;
    if (kv->fmt.type == KVC_KV_F32 && e <= nq) {
        if (want_v) return (const float *)kv->v[h] + (size_t)r0 * d;
        return narrow ? (const float *)kv->kp[h] + (size_t)r0 * kv->dk : (const float *)kv->k[h] + (size_t)(r0 - kv->np[h]) * d;
    }
    if (r0 >= nq) {
        *ld = 2 * (int64_t)d;
        return staged(kv, h, r0) + (want_v ? d : 0);
    }
    const int64_t t = e < nq ? e : nq; /* typed rows [r0, t), staging rows [nq, e) */
    if (want_v)
        values_typed(kv, h, r0, t - r0, buf);
    else
        keys_typed(kv, h, r0, t - r0, buf);
    for (int64_t r = nq; r < e; r++)
        memcpy(buf + (size_t)(r - r0) * d, staged(kv, h, r) + (want_v ? d : 0), sizeof(float) * (size_t)d);
    return buf;
}

const float *kvc_hkv_keys_f32(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    return rows_f32(kv, h, r0, n, 0, buf, ld);
}
const float *kvc_hkv_values_f32(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    return rows_f32(kv, h, r0, n, 1, buf, ld);
}
int64_t kvc_hkv_narrow_rows(const kvc_kv *kv, int32_t h) { return key_blocks(kv) ? 0 : kv->np[h]; }

int64_t kvc_hkv_tile(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, kvc_kv_tile *t) {
    if (!kvc_cpu_kv_tile_ok(&kv->fmt, kv->d) || r0 < kv->np[h] || r0 >= kv->nq[h]) return 0;
    const int64_t m = kv->nq[h] - r0 < n ? kv->nq[h] - r0 : n; /* rows stored in the type */
    return kvc_kv_tile_at(&kv->fmt, kv->d, (const uint8_t *)kv->k[h], kvc_kv_full_row(r0, kv->np[h]),
                          (const uint8_t *)kv->v[h], r0, m, t);
}

kvc_status kvc_kv_f32_get(const kvc_kv *kv, int want_v, int split, kvc_kv_f32 *out) {
    memset(out, 0, sizeof *out);
    const int32_t Hkv = kv->Hkv, d = kv->d, dk = key_blocks(kv) ? 0 : kv->dk;
    out->k = calloc((size_t)Hkv, sizeof *out->k);
    out->v = calloc((size_t)Hkv, sizeof *out->v);
    out->kp = calloc((size_t)Hkv, sizeof *out->kp);
    if (!out->k || !out->v || !out->kp) {
        kvc_kv_f32_drop(kv, out);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V view");
    }
    int in_place = kv->fmt.type == KVC_KV_F32 && (kv->dk == 0 || split);
    for (int32_t h = 0; h < Hkv && in_place; h++) in_place = kv->nq[h] >= kv->len[h];
    if (in_place) {
        for (int32_t h = 0; h < Hkv; h++) {
            out->k[h] = kv->k[h];
            out->v[h] = kv->v[h];
            out->kp[h] = kv->kp[h];
        }
        return KVC_OK;
    }
    /* copies: keys (expanded, or pruned and full apart: dk + d floats at most per row) and values */
    size_t floats = 0;
    for (int32_t h = 0; h < Hkv; h++) floats += (size_t)kv->len[h] * ((size_t)d + (size_t)dk + (want_v ? (size_t)d : 0));
    out->copy = kvc_malloc(sizeof(float) * (floats ? floats : 1), "f32 copy of a K/V store");
    if (!out->copy) {
        kvc_kv_f32_drop(kv, out);
        return KVC_ERR_NOMEM;
    }
    float *p = out->copy;
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t len = kv->len[h], np = dk == 0 ? 0 : kv->np[h] < len ? kv->np[h] : len;
        if (split && np > 0) {
            out->kp[h] = p;
            keys_typed(kv, h, 0, np, p); /* narrow rows: typed (committed before any prune) */
            p += (size_t)np * dk;
            out->k[h] = p;
            for (int64_t r = np; r < len; r++) key_get(kv, h, r, p + (size_t)(r - np) * d);
            p += (size_t)(len - np) * d;
        } else {
            out->k[h] = p;
            kvc_hkv_read(kv, h, 0, len, p, NULL);
            p += (size_t)len * d;
        }
        if (want_v) {
            out->v[h] = p;
            kvc_hkv_read(kv, h, 0, len, NULL, p);
            p += (size_t)len * d;
        }
    }
    return KVC_OK;
}

void kvc_kv_f32_drop(const kvc_kv *kv, kvc_kv_f32 *f) {
    (void)kv;
    free(f->k);
    free(f->v);
    free(f->kp);
    kvc_free(f->copy);
    memset(f, 0, sizeof *f);
}
