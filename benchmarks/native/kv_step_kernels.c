/* Nanoseconds per key of the CPU decode step's kernels over a working set of `keys` rows: small enough to stay
 * in cache (the kernels' arithmetic alone), or KEYS = 0: 512 MB of stored K/V, past the last-level cache (the step
 * as a long context streams it). Parts: the typed-tile kernels alone (backend/cpu/kv_decode.h: kvc_cpu_kv_scores
 * and kvc_cpu_kv_pv on 64-key tiles of one head, 3 query rows as SmolLM2's GQA gives, d = 64), both or either, and
 * `attention`: the whole decode attention (backend/cpu/cpu.h: kvc_cpu_attention, one query of 9 heads on 3 KV heads
 * as SmolLM2's layers have, its tasks, online softmax and merge, one thread) over the rows in their type, f32's
 * included: the f32 cache's attention, the baseline of every ratio, beside the types'.
 * benchmarks/kv_step_kernels.py compiles this with the build's flags and runs it; the best of `reps` passes is
 * printed, one line per run:
 *     <type> <keys> <part: both|scores|pv|attention> <ns per key> <GB/s of stored K/V bytes> */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "backend/cpu/cpu.h" /* -I csrc of the tree whose kernels are timed */
#include "backend/cpu/kv_decode.h"
#include "core/kv_type.h"

/* What the engine's files linked here (attention.c, weight_hint.c) ask of the rest of the backend: one thread, as
 * the step benchmarks run; kvc_hbuf_bytes is reached only through kvc_cpu_hint_weights (naming the next weights),
 * which nothing here calls */
int kvc_cpu_threads(void) { return 1; }
size_t kvc_hbuf_bytes(int32_t dtype, int64_t n) {
    (void)dtype, (void)n;
    fprintf(stderr, "kv_step_kernels: kvc_hbuf_bytes called (no weights are named here)\n");
    abort();
}

/* The K/V rows as the attention reads them (kvc_cpu_kvsrc) for HKV heads of `per` rows each, head after head as a
 * layer's heads are in the store: f32 rows in place, the typed ones as tiles in their type by the host store's
 * rule (kv_decode.h: kvc_kv_tile_at) */
#define HKV 3 /* SmolLM2's KV heads a layer (3 query rows each) */
typedef struct {
    const kvc_kv_format *f;
    int d;
    int64_t per; /* rows a head: a multiple of the tile and of KIVI's key block */
    const uint8_t *K, *V;
} rows_src;

static const float *f32_rows(const rows_src *r, const uint8_t *base, int32_t h, int64_t r0, int64_t *ld) {
    if (r->f->type != KVC_KV_F32) { /* the decode path reads typed rows as tiles; only a fallback would come here */
        fprintf(stderr, "kv_step_kernels: the attention asked for typed rows decoded (it left the decode path)\n");
        abort();
    }
    *ld = r->d;
    return (const float *)base + (size_t)(h * r->per + r0) * r->d;
}
static const float *keys_of(const void *src, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    (void)n, (void)buf;
    return f32_rows(src, ((const rows_src *)src)->K, h, r0, ld);
}
static const float *values_of(const void *src, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    (void)n, (void)buf;
    return f32_rows(src, ((const rows_src *)src)->V, h, r0, ld);
}
static int64_t typed_tile(const void *src, int32_t h, int64_t r0, int64_t n, kvc_kv_tile *t) {
    const rows_src *r = src;
    const int64_t row = h * r->per + r0;
    return kvc_kv_tile_at(r->f, r->d, r->K, row, r->V, row, n, t);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* random codes (xorshift64, 8 bytes a step: the working sets are hundreds of MB); every f16 scale and min 2^-7
 * (so the products stay finite whatever the codes) */
static void fill(uint8_t *p, size_t n) {
    static uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(p + i, &x, n - i < 8 ? n - i : 8);
    }
}
static void put_half(uint8_t *p) {
    const uint16_t h = 0x2000;
    memcpy(p, &h, 2);
}

/* n bytes on 2 MiB pages where the kernel grants them, as the host K/V store's arenas are (kvc_malloc_huge) */
static uint8_t *alloc_huge(size_t n) {
    void *p = NULL;
    const size_t huge = (size_t)2 << 20;
    if (posix_memalign(&p, huge, (n + huge - 1) / huge * huge)) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, (n + huge - 1) / huge * huge, MADV_HUGEPAGE);
#endif
    return p;
}

static const char *const NAMES[] = {"f32", "bf16", "f16", "q8_0", "kivi4", "kivi2"};
enum { BOTH, SCORES, PV, ATTENTION };

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TYPE(0 f32, 1 bf16, 2 f16, 3 q8_0, 4 kivi4, 5 kivi2) KEYS(0: 512 MB) REPS "
                        "PART(0 both, 1 scores, 2 pv, 3 attention; f32: attention alone)\n", argv[0]);
        return 2;
    }
    const int type = atoi(argv[1]), reps = atoi(argv[3]), part = atoi(argv[4]);
    const int d = 64, rows = 3, n = KVC_KV_TILE;
    kvc_kv_format f = {.type = type, .group = 64, .residual = 128};
    const int64_t want = atol(argv[2]) > 0 || type < KVC_KV_F32 || type > KVC_KV_KIVI2
                             ? atol(argv[2])
                             : (int64_t)((512ull << 20) / (kvc_kv_key_bytes(&f, d, KVC_KV_TILE) / KVC_KV_TILE + kvc_kv_row_bytes(&f, d)));
    const int64_t keys = want / (HKV * KVC_KV_TILE) * (HKV * KVC_KV_TILE); /* whole tiles in each head */
    if (keys < n || reps < 1 || type < KVC_KV_F32 || type > KVC_KV_KIVI2 || part < BOTH || part > ATTENTION ||
        (type == KVC_KV_F32 && part != ATTENTION)) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    if (type != KVC_KV_F32 && !kvc_cpu_kv_tile_ok(&f, d)) {
        printf("%s %lld - this build decodes such tiles to f32\n", NAMES[type], (long long)keys);
        return 0;
    }
    const int blocks = kvc_kv_type_key_blocks(type);
    const size_t rb = kvc_kv_row_bytes(&f, d), kb = blocks ? kvc_kivi_block_bytes(&f, d) : rb * (size_t)n;
    const size_t kbytes = (size_t)(keys / n) * kb, vbytes = (size_t)keys * rb;
    uint8_t *K = alloc_huge(kbytes + 64), *V = alloc_huge(vbytes + 64);
    if (!K || !V) return 1;
    fill(K, kbytes);
    fill(V, vbytes);
    if (blocks) { /* a key block: f16 scales and mins per channel, then codes; value rows: (scale, min) per group */
        for (int64_t b = 0; b < keys / n; b++)
            for (int c = 0; c < 2 * d; c++) put_half(K + (size_t)b * kb + 2 * (size_t)c);
        const int g = f.group < d ? f.group : d, gb = 4 + g * kvc_kv_type_bits(type) / 8;
        for (int64_t j = 0; j < keys; j++)
            for (int e = 0; e < d / g; e++) put_half(V + (size_t)j * rb + (size_t)e * gb), put_half(V + (size_t)j * rb + (size_t)e * gb + 2);
    } else if (type == KVC_KV_Q8_0) {
        for (int64_t j = 0; j < keys; j++)
            for (int b = 0; b < d / KVC_Q8_0_BLOCK; b++)
                put_half(K + (size_t)j * rb + (size_t)b * KVC_Q8_0_BYTES), put_half(V + (size_t)j * rb + (size_t)b * KVC_Q8_0_BYTES);
    } else if (type == KVC_KV_F32) { /* the random words as values in [-1, 1) */
        for (int i = 0; i < 2; i++) {
            uint8_t *p = i ? V : K;
            for (size_t e = 0; e < (i ? vbytes : kbytes) / 4; e++) {
                int32_t u;
                memcpy(&u, p + 4 * e, 4);
                const float x = (float)(u >> 8) / 8388608.f;
                memcpy(p + 4 * e, &x, 4);
            }
        }
    } else { /* f16 / bf16: the high byte of each value set to a normal magnitude in [2^-8, 1) (no subnormal f32,
              * whose products cost microcode assists) */
        for (size_t i = 1; i < kbytes || i < vbytes; i += 2) {
            const int r = rand();
            const uint8_t hi = (uint8_t)((r & 0x80) | (type == KVC_KV_F16 ? (0x1c + (r & 3) * 4) : (0x3c | (r & 3))));
            if (i < kbytes) K[i] = hi;
            if (i < vbytes) V[i] = hi;
        }
    }
    float q[HKV * 3 * 64], s[3 * 64], p[3 * 64], o[HKV * 3 * 64]; /* the attention: one query of HKV x 3 heads */
    for (int i = 0; i < HKV * 3 * 64; i++) q[i] = 0.01f * (float)(i % 7), o[i] = 0.f;
    for (int i = 0; i < 3 * 64; i++) p[i] = 1.f / 64;
    double best = 1e30, sink = 0.;
    const rows_src src = {&f, d, keys / HKV, K, V};
    /* as the host store's (cpu_backend.c): typed rows come as tiles, f32 ones in place; no pruned rows */
    const kvc_cpu_kvsrc kv = {.src = &src, .keys = keys_of, .values = values_of, .narrow = NULL, .dk = 0,
                              .tile = type == KVC_KV_F32 ? NULL : typed_tile, .decoded = type != KVC_KV_F32};
    int64_t past[HKV]; /* each query sees its head's every key (kvc_cpu_attention: keys < past + 1) */
    for (int h = 0; h < HKV; h++) past[h] = keys / HKV - 1;
    for (int r = 0; r < reps && part == ATTENTION; r++) {
        const double t0 = now();
        kvc_cpu_attention(q, HKV * rows * d, 1, HKV * rows, HKV, d, &kv, past, NULL, 0.125f, 0.f, o, HKV * rows * d);
        const double ns = (now() - t0) / (double)keys * 1e9;
        best = ns < best ? ns : best;
        sink += o[1];
    }
    for (int r = 0; r < reps && part != ATTENTION; r++) {
        const double t0 = now();
#if defined(KVC_KV_QROWS) /* kernels that keep a task's prepared queries (kv_decode.h); older ones (--against) do not */
        kvc_kv_query qc; /* as a decode task keeps them: prepared on its first tile */
        kvc_kv_query_reset(&qc);
#define SCORES(t) kvc_cpu_kv_scores(t, q, rows, n, s, n, &qc)
#else
#define SCORES(t) kvc_cpu_kv_scores(t, q, rows, n, s, n)
#endif
        for (int64_t j = 0; j < keys; j += n) {
#if defined(KVC_KV_QROWS)
            if (j % 6144 == 0) kvc_kv_query_reset(&qc); /* a task: at 8k tokens one thread splits 3 heads into 4 of 6144 keys */
#endif
            const kvc_kv_tile t = {&f, d, blocks ? K + (size_t)(j / n) * kb : K + (size_t)j * rb, blocks ? 0 : rb, 0,
                                   V + (size_t)j * rb, rb};
            if (part != 2) SCORES(&t);
            if (part != 1) kvc_cpu_kv_pv(&t, p, n, rows, n, o);
            sink += s[1] + o[1];
        }
        const double ns = (now() - t0) / (double)keys * 1e9;
        best = ns < best ? ns : best;
    }
    const char *parts[] = {"both", "scores", "pv", "attention"};
    printf("%s %lld %s %.2f %.2f\n", NAMES[type], (long long)keys, parts[part], best,
           ((double)(kbytes + vbytes) / (double)keys) / best);
    fprintf(stderr, "(checksum %g)\n", sink);
    free(K);
    free(V);
    return 0;
}
