/* The memory a decode step streams, without the model: a step reads each layer's weights, then that layer's K/V,
 * 30 times, then the LM head (SmolLM2-135M's shape: 96 MB of Q4_1 / Q8_0 weights a step, 30 MB of them the head),
 * over and over as decode does. Each byte is loaded once a pass (sums of 64-bit words, which the compiler
 * vectorises); nothing is computed. benchmarks/memory_share.py compiles and runs it. Usage:
 *     memory_share WEIGHTS_MB KV_MB [PASSES]
 * prints the best pass after two warm ones:  <weights GB/s> <K/V GB/s> <step ms>
 * With KV_MB 0 the weights alone cycle: if they fit the last-level cache this machine lends (on a shared host,
 * what its neighbours leave), they stream at its bandwidth; with K/V between the layers they compete for it. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LAYERS = 30 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t sink;

/* every 64-bit word of [p, p + n) loaded once (n a multiple of 64) */
static void stream(const uint64_t *p, size_t n) {
    uint64_t s[8] = {0};
    for (size_t i = 0; i < n / 8; i += 8)
        for (int k = 0; k < 8; k++) s[k] += p[i + k];
    for (int k = 0; k < 8; k++) sink += s[k];
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s WEIGHTS_MB KV_MB [PASSES]\n", argv[0]);
        return 2;
    }
    const size_t mb = (size_t)1 << 20, page = 4096;
    const size_t nw = (size_t)atoi(argv[1]) * mb, nk = (size_t)atoi(argv[2]) * mb;
    const int passes = argc > 3 ? atoi(argv[3]) : 12;
    const size_t head = nw * 30 / 96; /* the LM head's share of SmolLM2's 96 MB */
    const size_t wl = (nw - head) / LAYERS / page * page, kl = nk / LAYERS / page * page;
    uint64_t *w = aligned_alloc(page, nw + page), *k = aligned_alloc(page, nk + page);
    if (!w || !k) {
        fprintf(stderr, "memory_share: cannot allocate %zu + %zu MB\n", nw / mb, nk / mb);
        return 1;
    }
    memset(w, 1, nw + page);
    memset(k, 1, nk + page);
    double best = 1e30, best_w = 0, best_k = 0;
    for (int pass = 0; pass < passes + 2; pass++) {
        double tw = 0, tk = 0;
        const double t0 = now();
        for (int l = 0; l < LAYERS; l++) {
            const double a = now();
            stream((const uint64_t *)((const char *)w + (size_t)l * wl), wl);
            const double b = now();
            tw += b - a;
            if (kl) stream((const uint64_t *)((const char *)k + (size_t)l * kl), kl);
            tk += now() - b;
        }
        const double a = now();
        stream((const uint64_t *)((const char *)w + (size_t)LAYERS * wl), head / 64 * 64);
        tw += now() - a;
        const double t = now() - t0;
        if (pass >= 2 && t < best) best = t, best_w = tw, best_k = tk;
    }
    const double wbytes = (double)(LAYERS * wl + head / 64 * 64), kbytes = (double)(LAYERS * kl);
    printf("%.2f %.2f %.3f\n", wbytes / best_w / 1e9, kl ? kbytes / best_k / 1e9 : 0.0, best * 1e3);
    free(w);
    free(k);
    return sink == 42; /* keeps the loads */
}
