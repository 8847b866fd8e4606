/* The register-blocked microkernel shared by the GEMM and the attention kernel (scores Q K^T and the
 * update P V on tiles):
 *
 *   C[i, j] (+)= sum_p A[i * lda + p] * B[p * ldb + j],   i < mr <= KVC_MR, j < nr <= KVC_NR
 *
 * B's rows are vectors of KVC_NR lanes (a packed panel, or rows of V); A's values are broadcast one at
 * a time straight from its rows, so A needs no packing. The mr x NR tile of C lives in registers for
 * the whole p loop: the accumulators are named variables (gcc keeps those in registers but spills
 * arrays of vectors), and the body is instantiated for each mr so unused rows vanish.
 *
 * AVX-512: 8 x 32 tile = 16 zmm accumulators + 2 B vectors + 1 broadcast (of 32 registers): 16 FMAs
 * per 2 vector loads and 8 broadcasts, enough independent FMAs to hide the FMA latency.
 * AVX2+FMA: 6 x 16 tile = 12 ymm accumulators (of 16 registers).
 * Otherwise: plain C over a small array that the compiler may vectorise.
 * C is read and written with masked moves only at a right edge (nr < NR): AVX2's vmaskmovps store is
 * microcoded on AMD, and with k = 64 (attention scores) the masked stores of full tiles cost the
 * attention 13-27% (8192-token causal attention, 9 heads, 2 Zen 3 cores: 934 -> 811 ms in one process,
 * 1021 -> 746 ms in separate runs).
 * kvc_cpu_ukr_at reads A transposed (A[i, p] = a[p lda + i]): the attention's P V with P kept keys x
 * rows, so its broadcasts come from one contiguous row of P. */
#include <string.h>

#include "cpu.h"

#if defined(KVC_SIMD)

#define DECL(i) vf c##i##0 = V_ZERO(), c##i##1 = V_ZERO();
#define STEP(MR_, i, AI)                                                                               \
    if (MR_ > i) {                                                                                     \
        const vf ai = V_BCAST(AI(i));                                                                  \
        c##i##0 = V_FMA(ai, b0, c##i##0);                                                              \
        c##i##1 = V_FMA(ai, b1, c##i##1);                                                              \
    }
/* the p loop; LOAD0/LOAD1 fetch B's two vectors of row p (plain loads for a full tile, masked at
 * the right edge, where reading past column nr could leave the buffer) */
#define PLOOP(MR_, LOAD0, LOAD1, AP, AI)                                                               \
    for (int64_t p = 0; p < kc; p++) {                                                                 \
        const float *bp = b + p * ldb, *ap = AP;                                                       \
        const vf b0 = LOAD0, b1 = LOAD1;                                                               \
        STEP(MR_, 0, AI) STEP(MR_, 1, AI) STEP(MR_, 2, AI) STEP(MR_, 3, AI) STEP(MR_, 4, AI)           \
        STEP(MR_, 5, AI) STEP(MR_, 6, AI) STEP(MR_, 7, AI)                                             \
    }
#define STORE(MR_, i)                                                                                  \
    if (MR_ > i) {                                                                                     \
        float *ci = c + i * ldc;                                                                       \
        if (accumulate) {                                                                              \
            c##i##0 = V_ADD(c##i##0, full ? V_LOAD(ci) : V_LOADM(ci, m0));                             \
            c##i##1 = V_ADD(c##i##1, full ? V_LOAD(ci + VL) : V_LOADM(ci + VL, m1));                   \
        }                                                                                              \
        if (full) {                                                                                    \
            V_STORE(ci, c##i##0);                                                                      \
            V_STORE(ci + VL, c##i##1);                                                                 \
        } else {                                                                                       \
            V_STOREM(ci, m0, c##i##0);                                                                 \
            V_STOREM(ci + VL, m1, c##i##1);                                                            \
        }                                                                                              \
    }

/* A[i, p] is at a + i lda + p (A by rows: the GEMM, the attention's scores) or, for the `_at`
 * kernels, at a + p lda + i (A stored transposed: the attention's probabilities, keys x rows) */
#define A_ROWS(i) (ap + i * lda)
#define A_COLS(i) (ap + i)
#define UKR(MR_, NAME, AP, AI)                                                                          \
    static void NAME##MR_(int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, \
                          float *c, int64_t ldc, int accumulate) {                                     \
        DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7)                                \
        const vmask m0 = V_MASK(nr), m1 = V_MASK(nr - VL);                                             \
        const int full = nr == KVC_NR;                                                                 \
        /* C's rows are used only at the end: start fetching them now (L2/L3, not L1) */               \
        for (int i = 0; i < MR_; i++) {                                                                \
            _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);                                    \
            _mm_prefetch((const char *)(c + i * ldc + KVC_NR - 1), _MM_HINT_T0);                       \
        }                                                                                              \
        if (nr == KVC_NR)                                                                              \
            PLOOP(MR_, V_LOAD(bp), V_LOAD(bp + VL), AP, AI)                                            \
        else                                                                                           \
            PLOOP(MR_, V_LOADM(bp, m0), V_LOADM(bp + VL, m1), AP, AI)                                  \
        STORE(MR_, 0) STORE(MR_, 1) STORE(MR_, 2) STORE(MR_, 3) STORE(MR_, 4) STORE(MR_, 5)            \
        STORE(MR_, 6) STORE(MR_, 7)                                                                    \
    }

#else /* plain C */

#define A_ROWS(i) (a + (i) * lda + p)
#define A_COLS(i) (a + p * lda + (i))
#define UKR(MR_, NAME, AP, AI)                                                                          \
    static void NAME##MR_(int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, \
                          float *c, int64_t ldc, int accumulate) {                                     \
        float acc[MR_][KVC_NR];                                                                        \
        memset(acc, 0, sizeof acc);                                                                    \
        for (int64_t p = 0; p < kc; p++) {                                                             \
            const float *bp = b + p * ldb;                                                             \
            for (int i = 0; i < MR_; i++) {                                                            \
                const float ai = *AI(i);                                                               \
                for (int j = 0; j < nr; j++) acc[i][j] += ai * bp[j];                                  \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < MR_; i++)                                                                  \
            for (int j = 0; j < nr; j++) c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.f) + acc[i][j]; \
    }

#endif

/* X(m) for every row count m up to KVC_MR */
#if KVC_MR > 6
#define FOR_MR(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#elif KVC_MR > 4
#define FOR_MR(X) X(1) X(2) X(3) X(4) X(5) X(6)
#else
#define FOR_MR(X) X(1) X(2) X(3) X(4)
#endif

/* both kernels for every row count (unused rows vanish from each body) */
#define UKR_BOTH(MR_) UKR(MR_, ukr, a + p, A_ROWS) UKR(MR_, ukr_at, a + p * lda, A_COLS)
FOR_MR(UKR_BOTH)

#define CASE_UKR(M_) case M_: ukr##M_(nr, kc, a, lda, b, ldb, c, ldc, accumulate); return;
#define CASE_UKR_AT(M_) case M_: ukr_at##M_(nr, kc, a, lda, b, ldb, c, ldc, accumulate); return;

void kvc_cpu_ukr(int mr, int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc, int accumulate) {
    switch (mr) { FOR_MR(CASE_UKR) default: return; }
}

void kvc_cpu_ukr_at(int mr, int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                    int64_t ldc, int accumulate) {
    switch (mr) { FOR_MR(CASE_UKR_AT) default: return; }
}
