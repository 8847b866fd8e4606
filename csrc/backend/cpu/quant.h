/* Weights in their file's block format on the CPU (native weights): the one table of what the GEMM
 * and GEMV do per ggml type, the activation quantiser and the integer dot products.
 *
 * Decode (m <= a few rows) reads every weight once per token, so it is bound by the bytes read: the
 * activation row is quantised once to 32-value int8 blocks (kvc_q8row) and each weight row is dotted
 * against it block by block in integers, as llama.cpp does (q4_0 . q8_0 and friends); types without
 * an integer kernel (Q2_K, Q3_K, Q5_K, F16, BF16) decode each weight row to fp32 and take an fp32 dot.
 * Prefill (the blocked GEMM) decodes weight panels to fp32 in its packing step (gemm.c), so the
 * microkernel is the fp32 one. Every integer kernel has a plain-C twin, the reference the tests
 * compare it with (kvc_cpu_qdot with ref = 1). Weight rows may lie in place in a mapped model file
 * (model.c: maps()): kernels may assume only 2-byte alignment of a block or 16-bit row, 4 of an f32 row.
 * Internal to backend/cpu. */
#ifndef KVC_CPU_QUANT_H
#define KVC_CPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* A weight matrix as the GEMM reads it: `rows` rows of ggml type `type` (0: f32), row_bytes each. Row j
 * at p + j * row_bytes (the file's layout), or with `packed` in the interleaved layout below. */
typedef struct kvc_wmat {
    const void *p;
    int32_t type;
    size_t row_bytes;
    int64_t rows;
    int32_t packed;
} kvc_wmat;

/* The interleaved layout of the decode GEMV (types kvc_cpu_wtype_packs: Q4_0, Q4_1, Q8_0), made by the
 * CPU backend when it uploads such a weight; same bytes in all, so memory is the file's. Rows come in
 * groups of KVC_QG; the last rows % KVC_QG rows stay as in the file. Within a group, block b of all its
 * rows is one run of KVC_QG blocks' bytes: each 2-byte scale field (d; Q4_1's m) of the KVC_QG rows in
 * turn, then the codes in 4-byte pieces, piece i of rows 0..15 in turn. So one 64-byte load gives 4
 * codes of each of 16 rows (a vpdpbusd lane per row: the 16 rows' sums come out in one register and
 * need no horizontal sum), and one 32-byte load the 16 rows' scales. */
#define KVC_QG 16
int kvc_cpu_wtype_packs(int32_t type);
/* Write row j (its file bytes, src) of a matrix of `rows` rows, row_bytes each, into base, interleaved. */
void kvc_cpu_wpack_row(int32_t type, int64_t rows, size_t row_bytes, void *base, int64_t j, const void *src);
/* Blocks [b0, b0 + nb) of row j of w in the file's layout: a pointer into w, or into dst after copying
 * them there (packed rows). */
const void *kvc_cpu_wrow_blocks(kvc_wmat w, int64_t j, int64_t b0, int64_t nb, void *dst);

/* A quantised activation row of k values, k / 32 blocks: x[32 b + j] ~ d[b] q[32 b + j], and s[b] =
 * d[b] sum_j q[32 b + j] (the offset terms of Q4_1 / Q5_1 and the bias of the unsigned encodings).
 * Scales apart from the codes, so the kernel loads 16 blocks' scales as one vector. */
typedef struct kvc_q8row {
    float *d, *s;
    int8_t *q;
} kvc_q8row;

/* 1 if the CPU GEMM takes weights of this ggml type as stored (backend table: weight_type_ok). */
int kvc_cpu_wtype_ok(int32_t type);
/* 1 if the type has an integer dot product against kvc_q8row (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K). */
int kvc_cpu_wtype_int8(int32_t type);
/* Q4_K and Q6_K: their integer dot products live in quant_k.c (kvc_cpu_qdot hands them over). */
int kvc_cpu_wtype_kint8(int32_t type);
float kvc_cpu_qdot_k(int32_t type, const void *w, kvc_q8row a, int64_t k, int ref);
/* Quantise k values (k % 32 == 0) to k / 32 blocks: d = max|x| / 127, q = round-to-nearest-even(x / d). */
void kvc_cpu_quantize_q8(const float *x, int64_t k, kvc_q8row out);
/* sum over k values of weight row w (k / 32 blocks of `type`) times the activation blocks a: the
 * vectorised kernel, or with ref = 1 the plain-C reference. Only for kvc_cpu_wtype_int8 types. */
float kvc_cpu_qdot(int32_t type, const void *w, kvc_q8row a, int64_t k, int ref);
/* The prefill GEMM's panel straight from packed groups: bp[p * ldb + r] = W[j0 + r][c0 + p] for nr
 * rows that are whole groups (else 0: nothing done, the caller decodes row by row). */
int kvc_cpu_wdecode_panel(kvc_wmat w, int64_t j0, int nr, int64_t c0, int64_t kc, float *bp, int64_t ldb);
/* Decode values [c0, c0 + nc) of weight row w to fp32 (c0 and nc whole blocks). */
void kvc_cpu_wdecode(int32_t type, const void *w, int64_t c0, int64_t nc, float *dst);
/* C[m, n] (+)= A[m, k] W[n, k]^T for small m (decode): the row-streaming path of native weights
 * (packed groups: 16 rows at a time). */
void kvc_cpu_qgemv(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                   int accumulate);
/* The same with the plain-C integer dot products (tests). */
void kvc_cpu_qgemv_ref(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                       int accumulate);

#endif
