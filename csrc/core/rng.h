/* The one random-number rule of the project: splitmix64 (Steele, Lea, Flood 2014), host and device.
 * Every seeded draw (RandomPress's scores, LeverageScore's sketch, CAMPress's merges) is built on it, so
 * the CPU, the emulated device, CUDA and the NumPy references draw the same numbers. */
#ifndef KVC_RNG_H
#define KVC_RNG_H

#include <stdint.h>

#if defined(__CUDACC__)
#define KVC_RNG_FN __host__ __device__ static inline
#else
#define KVC_RNG_FN static inline
#endif

/* The splitmix64 finaliser of x + golden gamma: a stateless hash of x. */
KVC_RNG_FN uint64_t kvc_splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The next value of a splitmix64 stream whose state is *s (the state advances by the gamma). */
KVC_RNG_FN uint64_t kvc_splitmix64_next(uint64_t *s) {
    const uint64_t z = *s;
    *s += 0x9E3779B97F4A7C15ull;
    return kvc_splitmix64(z);
}

/* RandomPress's score of row r of head h at a layer: uniform in [0, 1) from 24 bits. */
KVC_RNG_FN float kvc_random_score(uint64_t seed, int32_t layer, int32_t h, int64_t r) {
    const uint64_t x = kvc_splitmix64(seed ^ kvc_splitmix64(((uint64_t)layer << 40) ^ ((uint64_t)h << 32) ^ (uint64_t)r));
    return (float)((double)(x >> 40) * (1.0 / 16777216.0));
}

#endif
