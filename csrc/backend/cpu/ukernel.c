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
 * Otherwise: plain C over a small array that the compiler may vectorise. */
#include <string.h>

#include "cpu.h"

#if defined(KVC_SIMD)

#define DECL(i) vf c##i##0 = V_ZERO(), c##i##1 = V_ZERO();
#define STEP(MR_, i)                                                                                   \
    if (MR_ > i) {                                                                                     \
        const vf ai = V_BCAST(ap + i * lda);                                                           \
        c##i##0 = V_FMA(ai, b0, c##i##0);                                                              \
        c##i##1 = V_FMA(ai, b1, c##i##1);                                                              \
    }
/* the p loop; LOAD0/LOAD1 fetch B's two vectors of row p (plain loads for a full tile, masked at
 * the right edge, where reading past column nr could leave the buffer) */
#define PLOOP(MR_, LOAD0, LOAD1)                                                                       \
    for (int64_t p = 0; p < kc; p++) {                                                                 \
        const float *bp = b + p * ldb, *ap = a + p;                                                    \
        const vf b0 = LOAD0, b1 = LOAD1;                                                               \
        STEP(MR_, 0) STEP(MR_, 1) STEP(MR_, 2) STEP(MR_, 3) STEP(MR_, 4) STEP(MR_, 5) STEP(MR_, 6)     \
        STEP(MR_, 7)                                                                                   \
    }
#define STORE(MR_, i)                                                                                  \
    if (MR_ > i) {                                                                                     \
        float *ci = c + i * ldc;                                                                       \
        if (accumulate) {                                                                              \
            c##i##0 = V_ADD(c##i##0, V_LOADM(ci, m0));                                                 \
            c##i##1 = V_ADD(c##i##1, V_LOADM(ci + VL, m1));                                            \
        }                                                                                              \
        V_STOREM(ci, m0, c##i##0);                                                                     \
        V_STOREM(ci + VL, m1, c##i##1);                                                                \
    }

#define UKR(MR_)                                                                                        \
    static void ukr##MR_(int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb,  \
                         float *c, int64_t ldc, int accumulate) {                                      \
        DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7)                                \
        const vmask m0 = V_MASK(nr), m1 = V_MASK(nr - VL);                                             \
        /* C's rows are used only at the end: start fetching them now (L2/L3, not L1) */               \
        for (int i = 0; i < MR_; i++) {                                                                \
            _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);                                    \
            _mm_prefetch((const char *)(c + i * ldc + KVC_NR - 1), _MM_HINT_T0);                       \
        }                                                                                              \
        if (nr == KVC_NR)                                                                              \
            PLOOP(MR_, V_LOAD(bp), V_LOAD(bp + VL))                                                    \
        else                                                                                           \
            PLOOP(MR_, V_LOADM(bp, m0), V_LOADM(bp + VL, m1))                                          \
        STORE(MR_, 0) STORE(MR_, 1) STORE(MR_, 2) STORE(MR_, 3) STORE(MR_, 4) STORE(MR_, 5)            \
        STORE(MR_, 6) STORE(MR_, 7)                                                                    \
    }

#else /* plain C */

#define UKR(MR_)                                                                                        \
    static void ukr##MR_(int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb,  \
                         float *c, int64_t ldc, int accumulate) {                                      \
        float acc[MR_][KVC_NR];                                                                        \
        memset(acc, 0, sizeof acc);                                                                    \
        for (int64_t p = 0; p < kc; p++) {                                                             \
            const float *bp = b + p * ldb;                                                             \
            for (int i = 0; i < MR_; i++) {                                                            \
                const float ai = a[i * lda + p];                                                       \
                for (int j = 0; j < nr; j++) acc[i][j] += ai * bp[j];                                  \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < MR_; i++)                                                                  \
            for (int j = 0; j < nr; j++) c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.f) + acc[i][j]; \
    }

#endif

UKR(1)
UKR(2)
UKR(3)
UKR(4)
#if KVC_MR > 4
UKR(5)
UKR(6)
#endif
#if KVC_MR > 6
UKR(7)
UKR(8)
#endif

void kvc_cpu_ukr(int mr, int nr, int64_t kc, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc, int accumulate) {
    switch (mr) {
#define CASE(M_) \
    case M_: ukr##M_(nr, kc, a, lda, b, ldb, c, ldc, accumulate); return;
        CASE(1) CASE(2) CASE(3) CASE(4)
#if KVC_MR > 4
        CASE(5) CASE(6)
#endif
#if KVC_MR > 6
        CASE(7) CASE(8)
#endif
#undef CASE
        default: return;
    }
}
