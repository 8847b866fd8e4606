/* Internal header of the CPU backend: the kernels (one family per file), the GEMM microkernel that
 * the attention kernel reuses, the thread count, and a vectorised exp shared by softmax and SiLU. */
#ifndef KVC_CPU_H
#define KVC_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ---- kernels on host fp32 arrays (the table in cpu_backend.c resolves views to these) ---- */
void kvc_cpu_rmsnorm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows, int64_t dim,
                     float eps);
void kvc_cpu_rope(float *x, int64_t ld, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                  int32_t pairing, float mscale);
void kvc_cpu_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
void kvc_cpu_swiglu_rows(float *gu, int64_t ld, int64_t rows, int64_t F);
void kvc_cpu_geglu_rows(float *gu, int64_t ld, int64_t rows, int64_t F);
void kvc_cpu_scale_rows(float *x, int64_t ld, int64_t rows, int64_t cols, float alpha);
void kvc_cpu_add(float *y, const float *x, int64_t n);
void kvc_cpu_add_bias(float *y, int64_t ld, const float *b, int64_t rows, int64_t dim);
/* in place on n rows (stride ld) of `heads` heads of d values: RMSNorm of each head with weights w[d] */
void kvc_cpu_head_rmsnorm(float *x, int64_t ld, int64_t n, int32_t heads, int32_t d, const float *w, float eps);
/* causal GQA attention over a ragged cache: query i of head hq (row i of q, stride ldq) reads KV head
 * hq / (H / Hkv), whose rows (kv: past_len[h] + n of them) it sees up to past_len[h] + i + 1, from row
 * start[i * Hkv + h] on when start is not NULL (a sliding window); pruned keys score the query's kept
 * channels */
/* Where the attention reads head h's rows: f32 rows [r0, r0 + n), *ld floats apart, in place or decoded
 * into buf ([n, d] floats, *ld = d): a host store in any type (kv_store.c), or plain arrays. Keys of rows
 * below narrow(src, h) (ThinK's pruned rows stored narrow; NULL: none) hold the dk channels kidx[h dk ..]:
 * [n, dk]. */
struct kvc_kv_tile;
typedef struct kvc_cpu_kvsrc {
    const void *src;
    const float *(*keys)(const void *src, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld);
    const float *(*values)(const void *src, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld);
    int64_t (*narrow)(const void *src, int32_t h);
    int32_t dk;
    const int32_t *kidx;
    /* NULL, or: rows [r0, r0 + m) of head h, m <= n, as a tile the decode reads in the stored type
     * (kv_decode.h); returns m, 0 where those rows are read through keys and values */
    int64_t (*tile)(const void *src, int32_t h, int64_t r0, int64_t n, struct kvc_kv_tile *t);
    int32_t decoded; /* keys and values come decoded into the buffers (a store not in f32) */
} kvc_cpu_kvsrc;
/* cap > 0: scores capped to cap tanh(s / cap) before the softmax (Gemma 2's attention soft-capping) */
void kvc_cpu_attention(const float *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const kvc_cpu_kvsrc *kv,
                       const int64_t *past_len, const int64_t *start, float scale, float cap, float *out, int64_t ldo);

/* ---- GEMM pieces (gemm.c, ukernel.c, blas.c) ---- */
/* C[m,n] (+)= A[m,k] B[n,k]^T with row strides lda, ldc (B contiguous): the external BLAS when one is
 * loaded and the shape suits it, else the built-in kernel. */
void kvc_cpu_gemm(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                  int accumulate);
void kvc_cpu_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k); /* contiguous, C = */
/* The same over a weight in any format the CPU takes (quant.h: f32 goes to kvc_cpu_gemm; native
 * types: the integer / decoding GEMV for small m, else the blocked GEMM decoding in its packing). */
struct kvc_wmat;
void kvc_cpu_gemm_w(const float *a, int64_t lda, struct kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n,
                    int64_t k, int accumulate);
/* The blocked GEMM alone on such a weight, at any m (tests). */
void kvc_cpu_gemm_packed(const float *a, int64_t lda, struct kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n,
                         int64_t k, int accumulate);
/* The built-in GEMM alone (no external BLAS). */
void kvc_cpu_gemm_builtin(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n,
                          int64_t k, int accumulate);
/* The external CBLAS sgemm if one is loaded (returns 0 and does nothing otherwise). */
int kvc_cpu_gemm_blas(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      int accumulate);

/* Register tile of the microkernel: KVC_MR rows of A (broadcast) x KVC_NR columns (vector lanes). */
#if defined(__AVX512F__)
#define KVC_MR 8
#define KVC_NR 32
#elif defined(__AVX2__) && defined(__FMA__)
#define KVC_MR 6
#define KVC_NR 16
#else
#define KVC_MR 4
#define KVC_NR 16
#endif

/* A vector of VL floats and its operations, for the kernels written once for AVX-512 and AVX2. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVC_SIMD 1
#if defined(__AVX512F__)
typedef __m512 vf;
typedef __mmask16 vmask;
#define VL 16 /* lanes */
#define V_ZERO() _mm512_setzero_ps()
#define V_MASK(n) ((__mmask16)((n) >= 16 ? 0xFFFF : (n) <= 0 ? 0 : (1u << (n)) - 1))
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_LOADM(p, mk) _mm512_maskz_loadu_ps(mk, p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_STOREM(p, mk, v) _mm512_mask_storeu_ps(p, mk, v)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_EXP(x) kvc_exp512(x)
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vf;
typedef __m256i vmask;
#define VL 8
/* lanes j < n: maskload/maskstore never touch the others */
#define V_MASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_LOADM(p, mk) _mm256_maskload_ps(p, mk)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_STOREM(p, mk, v) _mm256_maskstore_ps(p, mk, v)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_EXP(x) kvc_exp256(x)
static inline float kvc_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define V_HSUM(v) kvc_hsum256(v)
#endif
#endif

/* ---- software prefetch ----
 * The cache lines of [p, p + n) asked for now, from the line that holds p (so an unaligned range's last
 * line is asked for too): into L1 (prefetcht0) for the decode GEMV's weights (quant.c) and the K/V decode
 * steps' rows (kv_simd.h), into L2 (prefetcht2) for the next weights fetched under an attention
 * (weight_hint.c) and q8_0's next tile (kv_rows_step.c). Always inlined: a function of prefetches alone
 * looks free of effects to GCC, which drops calls to it. */
#define KVC_PREFETCH_LINES(p, n, locality)                                                              \
    for (uintptr_t x_ = (uintptr_t)(p) & ~(uintptr_t)63; x_ < (uintptr_t)(p) + (n); x_ += 64)          \
    __builtin_prefetch((const char *)x_, 0, locality)
static inline __attribute__((always_inline)) void kvc_prefetch_lines(const void *p, size_t n) { KVC_PREFETCH_LINES(p, n, 3); }
static inline __attribute__((always_inline)) void kvc_prefetch_lines_l2(const void *p, size_t n) { KVC_PREFETCH_LINES(p, n, 1); }

/* C[i, j] (+)= sum_p A[i * lda + p] * B[p * ldb + j]   for i < mr <= KVC_MR, j < nr <= KVC_NR, p < kc.
 * Overwrites C when accumulate == 0. Reads no B column >= nr (safe at the end of a buffer). */
void kvc_cpu_ukr(int mr, int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc, int accumulate);
/* The same with A stored transposed: A[i, p] = a[p * lda + i]. */
void kvc_cpu_ukr_at(int mr, int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                    int64_t ldc, int accumulate);

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (16 x 16 register blocks with AVX-512,
 * 8 x 8 with AVX2). */
void kvc_cpu_transpose(const float *src, int64_t lds, int64_t rows, int64_t cols, float *dst, int64_t ldd);

/* Threads the CPU kernels use (kvc_set_num_threads; default: all cores). */
int kvc_cpu_threads(void);

/* ---- vectorised exp ----
 * exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, e^r by its Taylor series to degree 7
 * (truncation error < 1e-8 relative, below fp32 rounding). Inputs below -87.3 give exactly 0 (so a
 * masked score of -inf contributes nothing); inputs above 88.7 are clamped to it (about 3.3e38). */
/* r = x - n ln2 (ln2 split in two parts), then p = e^r in Horner form, for vectors of either width */
#define KVC_EXP_REDUCE_TAYLOR(FMA, FNMA, SET1, x, n, r, p)  \
    r = FNMA(n, SET1(0.693359375f), x);                      \
    r = FNMA(n, SET1(-2.12194440e-4f), r);                   \
    p = SET1(1.f / 5040.f);                                  \
    p = FMA(p, r, SET1(1.f / 720.f));                        \
    p = FMA(p, r, SET1(1.f / 120.f));                        \
    p = FMA(p, r, SET1(1.f / 24.f));                         \
    p = FMA(p, r, SET1(1.f / 6.f));                          \
    p = FMA(p, r, SET1(0.5f));                               \
    p = FMA(p, r, SET1(1.f));                                \
    p = FMA(p, r, SET1(1.f))

#if defined(__AVX512F__)
static inline __m512 kvc_exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r, p;
    KVC_EXP_REDUCE_TAYLOR(_mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_set1_ps, x, n, r, p);
    return _mm512_maskz_mov_ps((__mmask16)~zero, _mm512_scalef_ps(p, n));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* the same on 8 lanes; 2^n is built in the exponent bits, so the upper clamp is 88.3 (n <= 127).
 * n comes from one FMA: t = x / ln2 + 1.5 * 2^23 + 127 has ulp 1, so its low mantissa bits hold
 * n + 127, which a shift by 23 turns into the bits of 2^n (no round, no conversion). */
static inline __m256 kvc_exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f), shift = _mm256_set1_ps(12583039.f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ); /* false below lo and for NaN/-inf */
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift);
    const __m256 n = _mm256_sub_ps(t, shift);
    __m256 r, p;
    KVC_EXP_REDUCE_TAYLOR(_mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_set1_ps, x, n, r, p);
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

/* y[i] = exp(x[i]) for i < n (y may alias x). */
static inline void kvc_vexp(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, kvc_exp512(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, kvc_exp512(_mm512_maskz_loadu_ps(m, x + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, kvc_exp256(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = x[i] < -87.3f ? 0.f : expf(x[i]);
#else
    for (; i < n; i++) y[i] = x[i] < -87.3f ? 0.f : expf(x[i]);
#endif
}

#endif
