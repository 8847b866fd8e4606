/* The K/V storage types on the CPU (kv_decode.c): tiles decoded for the attention and rows encoded for a
 * commit, vectorised where the build has AVX-512 or AVX2 + FMA + F16C, equal bit for bit to core/kv_type.h's
 * plain-C decoders and encoders (which run otherwise, and which the tests hold these to); and KIVI's decode
 * step on the stored bytes (kv_kivi_step.c). Internal to the host K/V store and the CPU attention. */
#ifndef KVC_CPU_KV_DECODE_H
#define KVC_CPU_KV_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "../../core/kv_type.h"
#include "../../include/kvpress_c.h"

/* n rows stored alone (f32, f16, bf16, q8_0, and KIVI's values), `stride` bytes apart, of w values each,
 * into out [n, w]. */
void kvc_cpu_kv_decode_rows(const kvc_kv_format *f, const void *src, size_t stride, int64_t n, int32_t w, float *out);
/* Rows [r0, r0 + n) of a KIVI key block (core/kv_type.h: f->group rows of w channels) into out [n, w]. */
void kvc_cpu_kivi_decode_block(const kvc_kv_format *f, const void *block, int32_t w, int32_t r0, int32_t n, float *out);
/* One row of w f32 values into the type, as core/kv_type.h's kvc_kv_encode_row writes it (bit for bit;
 * vectorised for f16, bf16 and q8_0 rows of whole blocks). */
void kvc_cpu_kv_encode_row(const kvc_kv_format *f, const float *x, int32_t w, void *dst);
/* 1 when this build decodes with vector instructions (the plain-C decoders run otherwise) */
int kvc_cpu_kv_decode_simd(void);

/* The decode step on the stored bytes: a tile of key and value rows of one head in the store's type (rows
 * all in the type, none ThinK-pruned; KIVI keys: inside one key block), read where they lie, the
 * dequantisation folded into the dot products and the P V update (nothing is written back to f32). */
#define KVC_KV_TILE 64 /* most rows a tile holds */
typedef struct kvc_kv_tile {
    const kvc_kv_format *f;
    int32_t d;
    const uint8_t *k; /* rows stored alone: the first key row; KIVI: the key block */
    size_t kstride;   /* bytes from a key row to the next (rows stored alone) */
    int32_t kr0;      /* KIVI: the first row's index in its block */
    const uint8_t *v; /* the first value row */
    size_t vstride;
} kvc_kv_tile;
/* The tile at row `row` of a head, at most n rows: at most KVC_KV_TILE, and KIVI's inside one key block (of the
 * blocks from k); rows stored alone have their key row at k's row `krow` (the row less the head's pruned rows,
 * which are stored apart) and their value row at v's row `row`. Returns the tile's rows. The one rule of the host
 * store's tiles (kv_store.c) and the kernels benchmark's (benchmarks/native/kv_step_kernels.c). */
static inline int64_t kvc_kv_tile_at(const kvc_kv_format *f, int32_t d, const uint8_t *k, int64_t krow, const uint8_t *v,
                                     int64_t row, int64_t n, kvc_kv_tile *t) {
    const size_t rb = kvc_kv_row_bytes(f, d);
    int64_t m = n < KVC_KV_TILE ? n : KVC_KV_TILE;
    t->f = f;
    t->d = d;
    if (kvc_kv_type_key_blocks(f->type)) {
        const int64_t G = f->group, in = row % G;
        m = m < G - in ? m : G - in;
        t->k = k + (size_t)(row / G) * kvc_kivi_block_bytes(f, d);
        t->kstride = 0;
        t->kr0 = (int32_t)in;
    } else {
        t->k = k + (size_t)krow * rb;
        t->kstride = rb;
        t->kr0 = 0;
    }
    t->v = v + (size_t)row * rb;
    t->vstride = rb;
    return m;
}
/* 1 when this build reads tiles of type f on heads of d channels in place (else decode them to f32) */
int kvc_cpu_kv_tile_ok(const kvc_kv_format *f, int32_t d);
/* A task's queries as a type's scores take them, prepared on its first tile and reused on the later ones,
 * where that form does not depend on the tile (q8_0 in int16 products: each row rounded to int16 steps, once a
 * task instead of once a tile; KIVI's depends on each key block's scales, f16's is Q itself). Reset it
 * (kvc_kv_query_reset) before a task's first tile and whenever the values at Q change; a call with another Q,
 * rows or d prepares them again. */
#define KVC_KV_QROWS 16 /* the most query rows kept prepared (more: prepared per tile) */
typedef struct kvc_kv_query {
    int ready;
    const float *q; /* what was prepared: Q, rows, d */
    int rows, d;
    float step[KVC_KV_QROWS];
    int32_t qp[KVC_KV_QROWS * 128]; /* d / 2 int32 a row, d <= 256 */
} kvc_kv_query;
/* a task's queries not prepared yet (the 8 KB of qp left as they are) */
static inline void kvc_kv_query_reset(kvc_kv_query *qc) {
    qc->ready = 0;
    qc->q = NULL;
    qc->rows = qc->d = 0;
}
/* S[r ls + j] = Q[r] . k_j for rows r < rows (Q [rows, d]) and the tile's rows j < n; qc: the task's prepared
 * queries (above), or NULL to prepare them for this tile alone */
void kvc_cpu_kv_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls, kvc_kv_query *qc);
/* O[r] += sum_j P[r ls + j] v_j for r < rows (O [rows, d]) */
void kvc_cpu_kv_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O);
/* The same three per kind of store, which the ones above dispatch to: rows stored alone (f16, bf16, q8_0:
 * kv_rows_step.c) and KIVI's key blocks (kv_kivi_step.c) */
int kvc_cpu_kv_rows_ok(const kvc_kv_format *f, int32_t d);
void kvc_cpu_kv_rows_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls, kvc_kv_query *qc);
void kvc_cpu_kv_rows_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O);
int kvc_cpu_kv_kivi_ok(const kvc_kv_format *f, int32_t d);
void kvc_cpu_kv_kivi_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls);
void kvc_cpu_kv_kivi_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O);
/* 1 when this build's step on a tile of type `type` read in place multiplies int16 weights by the codes
 * (AVX-512 VNNI: KIVI and q8_0; AVX2: q8_0; the query side and P's side rounded to int16 per query row and
 * tile), 0 when it multiplies floats */
int kvc_cpu_kv_step_int16(int32_t type);

/* 1 when the decode step on tiles of type `type` read in place is bound by its arithmetic rather than its bytes,
 * so memory has room for the next weights while it runs (weight_hint.h): the types of 8 bits a value or fewer
 * (q8_0, KIVI); f16 and bf16 tiles are read at memory speed (17 ns a key from memory, 8 in L2, d 64, 3 rows),
 * and fetching weights beside them measured no faster (f16 at 8k tokens: median 24.1 -> 24.5 ms a step) */
static inline int kvc_cpu_kv_step_spare(int32_t type) { return kvc_kv_type_bits(type) <= 8; }

#endif
