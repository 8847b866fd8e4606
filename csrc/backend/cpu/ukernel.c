/* The register-blocked GEMM microkernel shared by the GEMM (packed panels) and the attention kernel
 * (scores Q K^T and the update P V on tiles).
 *
 *   C[i, j] (+)= sum_p A[i*rsa + p*csa] * B[p*ldb + j],   i < mr <= KVC_MR, j < nr <= KVC_NR
 *
 * B's rows are contiguous vectors of KVC_NR lanes; A's values are broadcast one at a time, so A can be
 * any strided view (packed [p][MR] panels for the GEMM, plain rows for attention). The mr x NR tile of
 * C lives in registers for the whole k loop. The body is instantiated for each mr (switch below) so
 * the compiler unrolls the row loop and keeps every accumulator in a register; the packed case
 * (rsa = 1, csa = KVC_MR) gets its own instance with constant strides.
 *
 * AVX-512: 8 x 32 tile = 16 zmm accumulators + 2 B vectors + 1 broadcast (of 32 registers): 16 FMAs
 * per 2 vector loads and 8 broadcasts, enough independent FMAs to hide the FMA latency.
 * AVX2+FMA: 6 x 16 tile (12 ymm accumulators). Otherwise plain C that the compiler may vectorise. */
#include <string.h>

#include "cpu.h"

#if defined(__AVX512F__)

/* Named accumulators, not arrays: gcc keeps named vectors in registers but spills arrays of them. */
#define DECL(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
#define STEP(MR_, i, RSA)                                                                                    \
    if (MR_ > i) {                                                                                     \
        const __m512 ai = _mm512_set1_ps(ap[i * (RSA)]);                                               \
        c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);                                                    \
        c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);                                                    \
    }
#define STORE(MR_, i)                                                                                       \
    if (MR_ > i) {                                                                                     \
        float *ci = c + i * ldc;                                                                       \
        if (accumulate) {                                                                              \
            c##i##0 = _mm512_add_ps(c##i##0, _mm512_maskz_loadu_ps(m0, ci));                           \
            c##i##1 = _mm512_add_ps(c##i##1, _mm512_maskz_loadu_ps(m1, ci + 16));                      \
        }                                                                                              \
        _mm512_mask_storeu_ps(ci, m0, c##i##0);                                                        \
        _mm512_mask_storeu_ps(ci + 16, m1, c##i##1);                                                   \
    }

/* C's rows are touched only at the end: start fetching them now (they are in L2/L3, not L1) */
#define PREF(MR_)                                                                                      \
    for (int i = 0; i < MR_; i++) {                                                                    \
        _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);                                        \
        _mm_prefetch((const char *)(c + i * ldc + 16), _MM_HINT_T0);                                   \
    }
#define UKR_BODY(MR_, RSA, CSA)                                                                        \
    do {                                                                                               \
        DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7)                                \
        const __mmask16 m0 = (__mmask16)(nr >= 16 ? 0xFFFF : (1u << nr) - 1);                          \
        const __mmask16 m1 = (__mmask16)(nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : (1u << (nr - 16)) - 1);    \
        PREF(MR_)                                                                                      \
        for (int64_t p = 0; p < kc; p++) {                                                             \
            const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + p * ldb);                                  \
            const __m512 b1 = _mm512_maskz_loadu_ps(m1, b + p * ldb + 16);                             \
            const float *ap = a + p * (CSA);                                                           \
            STEP(MR_, 0, RSA) STEP(MR_, 1, RSA) STEP(MR_, 2, RSA) STEP(MR_, 3, RSA)                                        \
            STEP(MR_, 4, RSA) STEP(MR_, 5, RSA) STEP(MR_, 6, RSA) STEP(MR_, 7, RSA)                                        \
        }                                                                                              \
        STORE(MR_, 0) STORE(MR_, 1) STORE(MR_, 2) STORE(MR_, 3) STORE(MR_, 4) STORE(MR_, 5) STORE(MR_, 6) STORE(MR_, 7)                        \
    } while (0)

#elif defined(__AVX2__) && defined(__FMA__)

/* lanes j < nr of a ymm: maskload/maskstore never touch the others */
static inline __m256i lane_mask(int nr) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define UKR_BODY(MR_, RSA, CSA)                                                                        \
    do {                                                                                               \
        __m256 c0[MR_], c1[MR_];                                                                       \
        for (int i = 0; i < MR_; i++) c0[i] = c1[i] = _mm256_setzero_ps();                             \
        const __m256i m0 = lane_mask(nr), m1 = lane_mask(nr - 8);                                      \
        for (int64_t p = 0; p < kc; p++) {                                                             \
            const __m256 b0 = _mm256_maskload_ps(b + p * ldb, m0);                                     \
            const __m256 b1 = _mm256_maskload_ps(b + p * ldb + 8, m1);                                 \
            const float *ap = a + p * (CSA);                                                           \
            for (int i = 0; i < MR_; i++) {                                                            \
                const __m256 ai = _mm256_broadcast_ss(ap + i * (RSA));                                 \
                c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);                                                \
                c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);                                                \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < MR_; i++) {                                                                \
            float *ci = c + i * ldc;                                                                   \
            if (accumulate) {                                                                          \
                c0[i] = _mm256_add_ps(c0[i], _mm256_maskload_ps(ci, m0));                              \
                c1[i] = _mm256_add_ps(c1[i], _mm256_maskload_ps(ci + 8, m1));                          \
            }                                                                                          \
            _mm256_maskstore_ps(ci, m0, c0[i]);                                                        \
            _mm256_maskstore_ps(ci + 8, m1, c1[i]);                                                    \
        }                                                                                              \
    } while (0)

#else

#define UKR_BODY(MR_, RSA, CSA)                                                                        \
    do {                                                                                               \
        float acc[MR_][KVC_NR];                                                                        \
        memset(acc, 0, sizeof acc);                                                                    \
        for (int64_t p = 0; p < kc; p++) {                                                             \
            const float *bp = b + p * ldb;                                                             \
            for (int i = 0; i < MR_; i++) {                                                            \
                const float ai = a[i * (RSA) + p * (CSA)];                                             \
                for (int j = 0; j < nr; j++) acc[i][j] += ai * bp[j];                                  \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < MR_; i++)                                                                  \
            for (int j = 0; j < nr; j++) c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.f) + acc[i][j]; \
    } while (0)

#endif

/* One instance per row count, general strides. */
#define UKR_GENERAL(MR_)                                                                                \
    static void ukr_g##MR_(int nr, int64_t kc, const float *a, int64_t rsa, int64_t csa, const float *b, \
                           int64_t ldb, float *c, int64_t ldc, int accumulate) {                       \
        UKR_BODY(MR_, rsa, csa);                                                                       \
    }
/* One instance per row count, packed A panel ([p][KVC_MR]). */
#define UKR_PACKED(MR_)                                                                                 \
    static void ukr_p##MR_(int nr, int64_t kc, const float *a, const float *b, int64_t ldb, float *c,   \
                           int64_t ldc, int accumulate) {                                              \
        UKR_BODY(MR_, 1, KVC_MR);                                                                      \
    }

#define UKR_BOTH(MR_) UKR_GENERAL(MR_) UKR_PACKED(MR_)
UKR_BOTH(1)
UKR_BOTH(2)
UKR_BOTH(3)
UKR_BOTH(4)
#if KVC_MR > 4
UKR_BOTH(5)
UKR_BOTH(6)
#endif
#if KVC_MR > 6
UKR_BOTH(7)
UKR_BOTH(8)
#endif

void kvc_cpu_ukr(int mr, int nr, int64_t kc, const float *a, int64_t rsa, int64_t csa, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int accumulate) {
    if (rsa == 1 && csa == KVC_MR) {
        switch (mr) {
#define P(M_) \
    case M_: ukr_p##M_(nr, kc, a, b, ldb, c, ldc, accumulate); return;
            P(1) P(2) P(3) P(4)
#if KVC_MR > 4
            P(5) P(6)
#endif
#if KVC_MR > 6
            P(7) P(8)
#endif
#undef P
            default: return;
        }
    }
    switch (mr) {
#define G(M_) \
    case M_: ukr_g##M_(nr, kc, a, rsa, csa, b, ldb, c, ldc, accumulate); return;
        G(1) G(2) G(3) G(4)
#if KVC_MR > 4
        G(5) G(6)
#endif
#if KVC_MR > 6
        G(7) G(8)
#endif
#undef G
        default: return;
    }
}
