/* GEMM of the CPU backend: C[m,n] (+)= A[m,k] * B[n,k]^T, fp32, row-major (B is a weight [out, in]; A
 * and C rows have their own strides, so a GEMM reads and writes column slices of fused activations).
 *
 * Built-in kernel, two shapes of work:
 *  - skinny (m <= SKINNY_M: decode steps, small chunks): each output is a dot product of two
 *    k-contiguous rows, so nothing is packed and B (the weight, read once) streams straight from
 *    memory; OpenMP splits n. At m = 1 this is a GEMV, bound by memory bandwidth.
 *  - blocked (BLIS-style, m > SKINNY_M): B is packed one panel of KVC_NR rows x KC at a time
 *    (transposed to [p][NR] so the microkernel loads it as vectors) into a buffer on each thread's
 *    stack; every KVC_MR-row panel of A (a block of MC rows) then passes under it, read in place
 *    (the microkernel broadcasts A's values, so A needs no packing). The microkernel (ukernel.c)
 *    keeps an MR x NR = 8 x 32 tile of C in 16 zmm registers over the KC loop. Threads split the
 *    B panels; no allocation, no barrier between blocks.
 *
 * Measured with benchmarks/gemm.py (results/gemm.json) on this machine: 2 cores of an AMD EPYC
 * (Zen 4, AVX-512), 2 threads, GFLOP/s of the best of several calls, OpenBLAS 0.3.34 from
 * scipy-openblas32 (SkylakeX kernels). "openblas" is the library as kvc_cpu_matmul calls it (single-
 * threaded, our threads each doing a slice of the columns), "native" the library's own threading.
 *
 *      m      n     k   builtin  openblas  native       m      n     k   builtin  openblas  native
 *      1    576   576      40.3      40.2    28.5     512    576   576     225.1     204.8   209.3
 *      1    192   576      20.5      20.9    22.2     512    192   576     223.0     194.6   200.7
 *      1   1536   576      53.0      51.7    14.5     512   1536   576     223.1     208.9   183.5
 *      1    576  1536      55.4      54.8    35.4     512    576  1536     224.8     198.0   178.3
 *      1  49152   576      16.2       7.0     6.9     512  49152   576     210.1     198.7   196.0
 *     64    576   576     202.8     174.5   176.7    2048    576   576     216.8     179.0   209.6
 *     64    192   576     186.6     157.2   155.2    2048    192   576     223.8     178.5   207.3
 *     64   1536   576     208.2     185.4   184.2    2048   1536   576     214.0     193.3   208.8
 *     64    576  1536     208.6     181.5   182.7    2048    576  1536     219.9     185.7   206.2
 *     64  49152   576     178.3     147.8   146.8    2048  49152   576     210.5     204.3   205.4
 *
 * At m = 1 the small shapes take 10-40 us and both are bound by call and thread overheads; on the
 * 49152-row lm_head (113 MB of weights) the built-in GEMV streams 32 GB/s, OpenBLAS 14.
 * One thread (CPU time, so less noisy here): builtin 99-112 GFLOP/s from m = 64, OpenBLAS 91-107;
 * the peak of one core is about 110. So the built-in kernel is as fast or faster in every regime
 * and kvc_cpu_matmul uses it everywhere on AVX-512, even with a BLAS loaded (blas.c, BLAS_MIN_M).
 * With AVX2 only (built with -march=x86-64-v3, OpenBLAS forced to its Haswell kernels) the built-in
 * 6 x 16 kernel ties or wins up to m = 64 and OpenBLAS is 5-10 % faster beyond: BLAS from m = 128.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/backend.h"
#include "../../model/dequant.h"
#include "cpu.h"
#include "quant.h"

#ifndef SKINNY_M
#define SKINNY_M 12 /* rows of A up to which the unpacked dot-product path runs */
#endif
#ifndef KC_MAX
#define KC_MAX 512   /* k per packed B panel (KC x NR floats, 64 KB at most: L2) */
#endif
#ifndef MC_MAX
#define MC_MAX 512   /* rows of A per block (1 MB at KC 512: L2/L3; B is repacked once per block) */
#endif
#define MC (MC_MAX / KVC_MR * KVC_MR) /* whole microkernel panels */
#define MIN_PAR_FLOPS 65536 /* below this many multiply-adds a call runs on one thread */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------- */
/* Skinny path: dot products over k, a tile of up to 4 rows of A x 4 rows of B at a time (the    */
/* accumulators are reduced once, at the end of k).                                               */

#if defined(KVC_SIMD)
#define DOT_DECL(i) vf s##i##0 = V_ZERO(), s##i##1 = s##i##0, s##i##2 = s##i##0, s##i##3 = s##i##0;
#define DOT_LOADS(LOAD)                                                                                \
    const vf y0 = LOAD(b + p), y1 = LOAD(b + k + p), y2 = LOAD(b + 2 * k + p), y3 = LOAD(b + 3 * k + p);
#define DOT_STEP(IM, i, LOAD)                                                                          \
    if (IM > i) {                                                                                      \
        const vf x = LOAD(a + i * lda + p);                                                              \
        s##i##0 = V_FMA(x, y0, s##i##0);                                                               \
        s##i##1 = V_FMA(x, y1, s##i##1);                                                               \
        s##i##2 = V_FMA(x, y2, s##i##2);                                                               \
        s##i##3 = V_FMA(x, y3, s##i##3);                                                               \
    }
#define DOT_OUT(IM, i)                                                                                 \
    if (IM > i) {                                                                                      \
        float *ci = c + i * ldc;                                                                       \
        ci[0] = acc * ci[0] + V_HSUM(s##i##0);                                                         \
        ci[1] = acc * ci[1] + V_HSUM(s##i##1);                                                         \
        ci[2] = acc * ci[2] + V_HSUM(s##i##2);                                                         \
        ci[3] = acc * ci[3] + V_HSUM(s##i##3);                                                         \
    }
#define TAIL_LOAD(ptr) V_LOADM(ptr, tail)
#define DOT_TILE(IM)                                                                                   \
    static void dot_tile##IM(const float *a, int64_t lda, const float *b, float *c, int64_t k, int64_t ldc, \
                              float acc) {                                                     \
        DOT_DECL(0) DOT_DECL(1) DOT_DECL(2) DOT_DECL(3)                                                \
        int64_t p = 0;                                                                                 \
        for (; p + VL <= k; p += VL) {                                                                 \
            DOT_LOADS(V_LOAD)                                                                          \
            DOT_STEP(IM, 0, V_LOAD) DOT_STEP(IM, 1, V_LOAD) DOT_STEP(IM, 2, V_LOAD) DOT_STEP(IM, 3, V_LOAD) \
        }                                                                                              \
        if (p < k) {                                                                                   \
            const vmask tail = V_MASK((int)(k - p));                                                   \
            DOT_LOADS(TAIL_LOAD)                                                                       \
            DOT_STEP(IM, 0, TAIL_LOAD) DOT_STEP(IM, 1, TAIL_LOAD) DOT_STEP(IM, 2, TAIL_LOAD)           \
            DOT_STEP(IM, 3, TAIL_LOAD)                                                                 \
        }                                                                                              \
        DOT_OUT(IM, 0) DOT_OUT(IM, 1) DOT_OUT(IM, 2) DOT_OUT(IM, 3)                                    \
    }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)

/* im (<= 4) rows of A against 4 rows of B; acc 1 adds to C, 0 overwrites it */
static void dot_tile(int im, const float *a, int64_t lda, const float *b, float *c, int64_t k, int64_t ldc, float acc) {
    switch (im) {
        case 1: dot_tile1(a, lda, b, c, k, ldc, acc); break;
        case 2: dot_tile2(a, lda, b, c, k, ldc, acc); break;
        case 3: dot_tile3(a, lda, b, c, k, ldc, acc); break;
        default: dot_tile4(a, lda, b, c, k, ldc, acc); break;
    }
}

/* one row of A against 8 rows of B (decode GEMV: 8 independent streams of B in flight) */
static void dot_1x8(const float *a, const float *b, float *c, int64_t k, float acc) {
    vf s0 = V_ZERO(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t p = 0; p < k; p += VL) {
        const vmask mk = V_MASK((int)(k - p < VL ? k - p : VL));
        const vf x = V_LOADM(a + p, mk);
        s0 = V_FMA(x, V_LOADM(b + p, mk), s0);
        s1 = V_FMA(x, V_LOADM(b + k + p, mk), s1);
        s2 = V_FMA(x, V_LOADM(b + 2 * k + p, mk), s2);
        s3 = V_FMA(x, V_LOADM(b + 3 * k + p, mk), s3);
        s4 = V_FMA(x, V_LOADM(b + 4 * k + p, mk), s4);
        s5 = V_FMA(x, V_LOADM(b + 5 * k + p, mk), s5);
        s6 = V_FMA(x, V_LOADM(b + 6 * k + p, mk), s6);
        s7 = V_FMA(x, V_LOADM(b + 7 * k + p, mk), s7);
    }
    c[0] = acc * c[0] + V_HSUM(s0), c[1] = acc * c[1] + V_HSUM(s1), c[2] = acc * c[2] + V_HSUM(s2);
    c[3] = acc * c[3] + V_HSUM(s3), c[4] = acc * c[4] + V_HSUM(s4), c[5] = acc * c[5] + V_HSUM(s5);
    c[6] = acc * c[6] + V_HSUM(s6), c[7] = acc * c[7] + V_HSUM(s7);
}
#else
static void dot_tile(int im, const float *a, int64_t lda, const float *b, float *c, int64_t k, int64_t ldc, float acc) {
    for (int i = 0; i < im; i++)
        for (int j = 0; j < 4; j++) {
            const float *x = a + i * lda, *y = b + j * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t p = 0; p < k; p++) s += x[p] * y[p];
            c[i * ldc + j] = acc * c[i * ldc + j] + s;
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

static void gemm_skinny(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n,
                        int64_t k, int accumulate) {
    const int par = (double)m * n * k >= MIN_PAR_FLOPS && !omp_in_parallel();
    const float acc = accumulate ? 1.f : 0.f; /* 0 * c would turn an uninitialised NaN into NaN: select */
#if defined(KVC_SIMD)
    if (m == 1) { /* GEMV: 8 rows of B per step, the last n % 8 one by one */
        const int64_t nb = n / 8;
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
        for (int64_t jb = 0; jb <= nb; jb++) {
            if (jb < nb) {
                if (accumulate) dot_1x8(a, b + jb * 8 * k, c + jb * 8, k, acc);
                else {
                    float t[8] = {0};
                    dot_1x8(a, b + jb * 8 * k, t, k, 0.f);
                    memcpy(c + jb * 8, t, sizeof t);
                }
            } else {
                for (int64_t j = jb * 8; j < n; j++) c[j] = (accumulate ? c[j] : 0.f) + dot1(a, b + j * k, k);
            }
        }
        return;
    }
#endif
    const int64_t nb = n / 4;
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t jb = 0; jb <= nb; jb++) {
        const int64_t j0 = jb * 4;
        if (jb < nb) {
            for (int64_t i0 = 0; i0 < m; i0 += 4) {
                const int im = (int)imin(4, m - i0);
                if (accumulate) {
                    dot_tile(im, a + i0 * lda, lda, b + j0 * k, c + i0 * ldc + j0, k, ldc, acc);
                } else {
                    float t[16] = {0};
                    dot_tile(im, a + i0 * lda, lda, b + j0 * k, t, k, 4, 0.f);
                    for (int i = 0; i < im; i++) memcpy(c + (i0 + i) * ldc + j0, t + i * 4, sizeof(float) * 4);
                }
            }
        } else {
            for (int64_t j = j0; j < n; j++)
                for (int64_t i = 0; i < m; i++)
                    c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.f) + dot1(a + i * lda, b + j * k, k);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Transposition (packing B panels, the K tiles of attention).                                    */

void kvc_cpu_transpose(const float *src, int64_t lds, int64_t rows, int64_t cols, float *dst, int64_t ldd) {
    int64_t r0 = 0;
#if defined(__AVX512F__)
    /* 16 x 16 blocks transposed in registers */
    for (; r0 + 16 <= rows; r0 += 16) {
        int64_t c0 = 0;
        for (; c0 + 16 <= cols; c0 += 16) {
            __m512 r[16], t[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(src + (r0 + j) * lds + c0);
            for (int j = 0; j < 16; j += 2) { /* interleave row pairs */
                t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) { /* 4 x 4 blocks inside each 128-bit lane */
                r[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
                r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
                r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            for (int j = 0; j < 4; j++) { /* then the lanes themselves, in two rounds */
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
            /* r[x] now holds column c0 + x of the 16 rows */
            for (int x = 0; x < 16; x++) _mm512_storeu_ps(dst + (c0 + x) * ldd + r0, r[x]);
        }
        for (; c0 < cols; c0++)
            for (int j = 0; j < 16; j++) dst[c0 * ldd + r0 + j] = src[(r0 + j) * lds + c0];
    }
#elif defined(__AVX2__)
    /* 8 x 8 blocks transposed in registers */
    for (; r0 + 8 <= rows; r0 += 8) {
        int64_t c0 = 0;
        for (; c0 + 8 <= cols; c0 += 8) {
            __m256 r[8], t[8];
            for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + (r0 + j) * lds + c0);
            for (int j = 0; j < 8; j += 2) {
                t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 8; j += 4) {
                r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
                r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            for (int x = 0; x < 4; x++) { /* columns x and x + 4 */
                _mm256_storeu_ps(dst + (c0 + x) * ldd + r0, _mm256_permute2f128_ps(r[x], r[x + 4], 0x20));
                _mm256_storeu_ps(dst + (c0 + x + 4) * ldd + r0, _mm256_permute2f128_ps(r[x], r[x + 4], 0x31));
            }
        }
        for (; c0 < cols; c0++)
            for (int j = 0; j < 8; j++) dst[c0 * ldd + r0 + j] = src[(r0 + j) * lds + c0];
    }
#endif
    for (; r0 < rows; r0++) {
        const float *s = src + r0 * lds;
        for (int64_t c = 0; c < cols; c++) dst[c * ldd + r0] = s[c];
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Blocked path.                                                                                  */
/* The microkernel broadcasts A straight from its rows (8 row streams, k-contiguous: nothing to    */
/* pack); B is packed one panel at a time into a thread-local buffer that stays hot while every A  */
/* panel of the row block passes under it. Threads split the panels of each row block; they write  */
/* disjoint columns of C, so no barrier is needed between blocks.                                  */

/* Pack panel jp, columns [p0, p0 + kc), of weight w into bp[p][j] (lanes >= nr are masked by the
 * microkernel). Native weights are decoded to fp32 here, kc values of nr rows, then transposed: the
 * one place the blocked GEMM sees their format. */
static void pack_panel(kvc_wmat w, int64_t k, int64_t jp, int nr, int64_t p0, int64_t kc, float *bp, float *tmp) {
    if (w.type == 0) {
        kvc_cpu_transpose((const float *)w.p + jp * KVC_NR * k + p0, k, nr, kc, bp, KVC_NR);
        return;
    }
    if (kvc_cpu_wdecode_panel(w, jp * KVC_NR, nr, p0, kc, bp, KVC_NR)) return;
    const int64_t be = ggml_block_elems(w.type);
    uint8_t raw[KC_MAX / 32 * 34]; /* a packed row's blocks in the file's layout (packed types: 32-value blocks) */
    for (int j = 0; j < nr; j++)
        kvc_cpu_wdecode(w.type, kvc_cpu_wrow_blocks(w, jp * KVC_NR + j, p0 / be, kc / be, raw), 0, kc, tmp + j * kc);
    kvc_cpu_transpose(tmp, kc, nr, kc, bp, KVC_NR);
}

static void gemm_blocked(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n,
                         int64_t k, int accumulate) {
    /* equal chunks, no thin leftover; whole blocks of a native type (KC_MAX is a multiple of 256) */
    const int64_t be = w.type ? ggml_block_elems(w.type) : 1;
    int64_t kc_max = ceil_div(ceil_div(k, ceil_div(k, KC_MAX)), be) * be;
    if (kc_max > KC_MAX) kc_max = KC_MAX / be * be;
    const int64_t npan = ceil_div(n, KVC_NR);
    /* a native panel is decoded once per row block: larger row blocks decode less often */
    const int64_t mc_rows = w.type ? 4 * MC : MC;
    const int par = (double)m * n * k >= MIN_PAR_FLOPS && !omp_in_parallel();
#pragma omp parallel num_threads(kvc_cpu_threads()) if (par)
    {
        float bp[KC_MAX * KVC_NR] __attribute__((aligned(64)));
        float tmp[w.type ? KC_MAX * KVC_NR : 1];
        for (int64_t i0 = 0; i0 < m; i0 += mc_rows) {
            const int64_t mc = imin(mc_rows, m - i0), mpan = ceil_div(mc, KVC_MR);
#pragma omp for schedule(static) nowait
            for (int64_t jp = 0; jp < npan; jp++) {
                const int nr = (int)imin(KVC_NR, n - jp * KVC_NR);
                for (int64_t p0 = 0; p0 < k; p0 += kc_max) {
                    const int64_t kc = imin(kc_max, k - p0);
                    pack_panel(w, k, jp, nr, p0, kc, bp, tmp);
                    for (int64_t ip = 0; ip < mpan; ip++) {
                        const int64_t i = i0 + ip * KVC_MR;
                        kvc_cpu_ukr((int)imin(KVC_MR, i0 + mc - i), nr, kc, a + i * lda + p0, lda, bp, KVC_NR,
                                    c + i * ldc + jp * KVC_NR, ldc, accumulate || p0 > 0);
                    }
                }
            }
        }
    }
}

void kvc_cpu_gemm_builtin(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n,
                          int64_t k, int accumulate) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) { /* an empty sum */
        if (!accumulate)
            for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, sizeof(float) * (size_t)n);
        return;
    }
    if (m <= SKINNY_M)
        gemm_skinny(a, lda, b, c, ldc, m, n, k, accumulate);
    else
        gemm_blocked(a, lda, (kvc_wmat){b, 0, (size_t)k * sizeof(float), n, 0}, c, ldc, m, n, k, accumulate);
}

void kvc_cpu_gemm_w(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                    int accumulate) {
    if (w.type == 0) {
        kvc_cpu_gemm(a, lda, (const float *)w.p, c, ldc, m, n, k, accumulate);
        return;
    }
    if (m <= 0 || n <= 0) return;
    if (m <= SKINNY_M)
        kvc_cpu_qgemv(a, lda, w, c, ldc, m, n, k, accumulate);
    else
        gemm_blocked(a, lda, w, c, ldc, m, n, k, accumulate);
}

void kvc_cpu_gemm_packed(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                         int accumulate) {
    if (m > 0 && n > 0 && k > 0) gemm_blocked(a, lda, w, c, ldc, m, n, k, accumulate);
}
