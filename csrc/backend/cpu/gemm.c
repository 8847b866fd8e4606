/* GEMM of the CPU backend: C[m,n] = A[m,k] * B[n,k]^T, fp32, row-major (B is a weight [out, in]).
 *
 * Built-in kernel, two shapes of work:
 *  - skinny (m <= SKINNY_M, decode steps): each output is a dot product of two k-contiguous rows, so
 *    nothing is packed and B (the weight, read once) streams straight from memory; OpenMP splits n.
 *    This is a GEMV, bound by memory bandwidth.
 *  - blocked (BLIS-style): for each block of NC columns and KC of k, B is packed into panels of
 *    KVC_NR columns ([p][NR], so the microkernel loads B as vectors) and A into panels of KVC_MR
 *    rows ([p][MR], broadcast); the threads share the packed blocks and split the microtiles.
 *    The microkernel (ukernel.c) keeps an MR x NR tile of C in registers over the KC loop.
 * kvc_cpu_matmul (blas.c) chooses between this and an external BLAS; see the figures there. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "cpu.h"

#ifndef SKINNY_M
#define SKINNY_M 12 /* rows of A up to which the unpacked dot-product path runs */
#endif
#ifndef KC_MAX
#define KC_MAX 512   /* k per packed block: an A panel (MR x KC) stays in L1, a B panel in L2 */
#endif
#ifndef MC_MAX
#define MC_MAX 256   /* rows of A per packed block */
#endif
#define MIN_PAR_FLOPS 65536 /* below this many multiply-adds a call runs on one thread */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------- */
/* Skinny path: dot products over k, a tile of IM rows of A x 4 rows of B at a time.             */

#if defined(__AVX512F__)
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

#define DOT_DECL(i) __m512 s##i##0 = _mm512_setzero_ps(), s##i##1 = s##i##0, s##i##2 = s##i##0, s##i##3 = s##i##0;
#define DOT_STEP(IM, i, MASK)                                                                          \
    if (IM > i) {                                                                                      \
        const __m512 x = _mm512_maskz_loadu_ps(MASK, a + i * k + p);                                   \
        s##i##0 = _mm512_fmadd_ps(x, y0, s##i##0);                                                     \
        s##i##1 = _mm512_fmadd_ps(x, y1, s##i##1);                                                     \
        s##i##2 = _mm512_fmadd_ps(x, y2, s##i##2);                                                     \
        s##i##3 = _mm512_fmadd_ps(x, y3, s##i##3);                                                     \
    }
#define DOT_LOADS(MASK)                                                                                \
    const __m512 y0 = _mm512_maskz_loadu_ps(MASK, b + p), y1 = _mm512_maskz_loadu_ps(MASK, b + k + p); \
    const __m512 y2 = _mm512_maskz_loadu_ps(MASK, b + 2 * k + p);                                      \
    const __m512 y3 = _mm512_maskz_loadu_ps(MASK, b + 3 * k + p);
#define DOT_OUT(IM, i)                                                                                 \
    if (IM > i) {                                                                                      \
        c[i * ldc + 0] = hsum(s##i##0);                                                                \
        c[i * ldc + 1] = hsum(s##i##1);                                                                \
        c[i * ldc + 2] = hsum(s##i##2);                                                                \
        c[i * ldc + 3] = hsum(s##i##3);                                                                \
    }
#define DOT_TILE(IM)                                                                                   \
    static void dot_tile##IM(const float *a, const float *b, float *c, int64_t k, int64_t ldc) {       \
        DOT_DECL(0) DOT_DECL(1) DOT_DECL(2) DOT_DECL(3)                                                \
        int64_t p = 0;                                                                                 \
        for (; p + 16 <= k; p += 16) {                                                                 \
            DOT_LOADS(0xFFFF)                                                                          \
            DOT_STEP(IM, 0, 0xFFFF) DOT_STEP(IM, 1, 0xFFFF) DOT_STEP(IM, 2, 0xFFFF) DOT_STEP(IM, 3, 0xFFFF) \
        }                                                                                              \
        if (p < k) {                                                                                   \
            const __mmask16 tail = (__mmask16)((1u << (k - p)) - 1);                                   \
            DOT_LOADS(tail)                                                                            \
            DOT_STEP(IM, 0, tail) DOT_STEP(IM, 1, tail) DOT_STEP(IM, 2, tail) DOT_STEP(IM, 3, tail)    \
        }                                                                                              \
        DOT_OUT(IM, 0) DOT_OUT(IM, 1) DOT_OUT(IM, 2) DOT_OUT(IM, 3)                                    \
    }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)

/* im (<= 4) rows of A against 4 rows of B */
static void dot_tile(int im, const float *a, const float *b, float *c, int64_t k, int64_t ldc) {
    switch (im) {
        case 1: dot_tile1(a, b, c, k, ldc); break;
        case 2: dot_tile2(a, b, c, k, ldc); break;
        case 3: dot_tile3(a, b, c, k, ldc); break;
        default: dot_tile4(a, b, c, k, ldc); break;
    }
}
#else
static void dot_tile(int im, const float *a, const float *b, float *c, int64_t k, int64_t ldc) {
    for (int i = 0; i < im; i++)
        for (int j = 0; j < 4; j++) {
            const float *x = a + i * k, *y = b + j * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t p = 0; p < k; p++) s += x[p] * y[p];
            c[i * ldc + j] = s;
        }
}
#endif

/* one output, for the last n % 4 columns */
static float dot1(const float *x, const float *y, int64_t k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t p = 0; p < k; p++) s += x[p] * y[p];
    return s;
}

static void gemm_skinny(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = n / 4;
    const int par = (double)m * n * k >= MIN_PAR_FLOPS && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t jb = 0; jb <= nb; jb++) {
        const int64_t j0 = jb * 4;
        if (jb < nb) {
            for (int64_t i0 = 0; i0 < m; i0 += 4)
                dot_tile((int)imin(4, m - i0), a + i0 * k, b + j0 * k, c + i0 * n + j0, k, n);
        } else {
            for (int64_t j = j0; j < n; j++)
                for (int64_t i = 0; i < m; i++) c[i * n + j] = dot1(a + i * k, b + j * k, k);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Packing.                                                                                       */

/* B rows [j0, j0+nr) x columns [p0, p0+kc) -> dst[p][KVC_NR] (columns >= nr left unset: the
 * microkernel masks them). */
static void pack_b_panel(const float *b, int64_t k, int64_t j0, int nr, int64_t p0, int64_t kc, float *dst) {
    int64_t p = 0;
#if defined(__AVX512F__)
    /* 16 x 16 blocks transposed in registers (the panel is a transpose of B's rows) */
    for (int jg = 0; jg + 16 <= nr; jg += 16) {
        for (p = 0; p + 16 <= kc; p += 16) {
            __m512 r[16], t[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(b + (j0 + jg + j) * k + p0 + p);
            for (int j = 0; j < 16; j += 2) {
                t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) {
                r[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
                r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
                r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            for (int j = 0; j < 4; j++) {
                t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
                t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD);
                t[j + 8] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88);
                t[j + 12] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xDD);
            }
            for (int j = 0; j < 4; j++) {
                r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
                r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
                r[j + 4] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0x88);
                r[j + 12] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0xDD);
            }
            /* r[x] now holds column p + x of the 16 rows */
            for (int x = 0; x < 16; x++) _mm512_storeu_ps(dst + (p + x) * KVC_NR + jg, r[x]);
        }
        for (int64_t q = p; q < kc; q++)
            for (int j = 0; j < 16; j++) dst[q * KVC_NR + jg + j] = b[(j0 + jg + j) * k + p0 + q];
    }
    const int jdone = nr / 16 * 16;
#else
    const int jdone = 0;
#endif
    for (int j = jdone; j < nr; j++) {
        const float *src = b + (j0 + j) * k + p0;
        for (p = 0; p < kc; p++) dst[p * KVC_NR + j] = src[p];
    }
}

/* A rows [i0, i0+mr) x columns [p0, p0+kc) -> dst[p][KVC_MR] */
static void pack_a_panel(const float *a, int64_t k, int64_t i0, int mr, int64_t p0, int64_t kc, float *dst) {
    for (int i = 0; i < mr; i++) {
        const float *src = a + (i0 + i) * k + p0;
        for (int64_t p = 0; p < kc; p++) dst[p * KVC_MR + i] = src[p];
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Blocked path.                                                                                  */

static void gemm_blocked(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    /* k in equal chunks of at most KC_MAX (no thin leftover chunk) */
    const int64_t kc_max = ceil_div(k, ceil_div(k, KC_MAX));
    const int64_t mc_max = imin(MC_MAX, ceil_div(m, KVC_MR) * KVC_MR);
    const int64_t npan = ceil_div(n, KVC_NR);
    float *ap = aligned_alloc(64, (size_t)(mc_max * kc_max * sizeof(float) + 63) / 64 * 64);
    if (!ap) { /* no memory for the packed block: the unpacked path needs none */
        gemm_skinny(a, b, c, m, n, k);
        return;
    }
    const int par = (double)m * n * k >= MIN_PAR_FLOPS && !omp_in_parallel();
#pragma omp parallel num_threads(kvc_cpu_threads()) if (par)
    {
        /* this thread's packed B panel: KC x NR, hot in L1/L2 while every A panel passes under it */
        float bp[KC_MAX * KVC_NR] __attribute__((aligned(64)));
        for (int64_t p0 = 0; p0 < k; p0 += kc_max) {
            const int64_t kc = imin(kc_max, k - p0);
            for (int64_t i0 = 0; i0 < m; i0 += mc_max) {
                const int64_t mc = imin(mc_max, m - i0), mpan = ceil_div(mc, KVC_MR);
                /* A block shared by all threads; the barrier ending this `omp for` orders it before use */
#pragma omp for schedule(static)
                for (int64_t ip = 0; ip < mpan; ip++)
                    pack_a_panel(a, k, i0 + ip * KVC_MR, (int)imin(KVC_MR, mc - ip * KVC_MR), p0, kc,
                                 ap + ip * KVC_MR * kc);
                /* each thread takes a run of B panels; each panel meets every A panel of the block */
#pragma omp for schedule(static)
                for (int64_t jp = 0; jp < npan; jp++) {
                    const int nr = (int)imin(KVC_NR, n - jp * KVC_NR);
                    pack_b_panel(b, k, jp * KVC_NR, nr, p0, kc, bp);
                    for (int64_t ip = 0; ip < mpan; ip++)
                        kvc_cpu_ukr((int)imin(KVC_MR, mc - ip * KVC_MR), nr, kc, ap + ip * KVC_MR * kc, 1, KVC_MR,
                                    bp, KVC_NR, c + (i0 + ip * KVC_MR) * n + jp * KVC_NR, n, p0 > 0);
                }
            }
        }
    }
    free(ap);
}

void kvc_cpu_gemm_builtin(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    if (m <= SKINNY_M)
        gemm_skinny(a, b, c, m, n, k);
    else
        gemm_blocked(a, b, c, m, n, k);
}
