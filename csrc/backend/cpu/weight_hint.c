/* The weights a decode step reads after a layer's attention, fetched during that attention (weight_hint.h).
 * The default of 2048 bytes a 64-key tile (a kivi4 tile takes ~440 ns at 8k tokens of context: ~4.7 GB/s on
 * top of the K/V's ~10) was measured on the default model at 8k tokens, one thread, alternating runs (min,
 * median of 6): kivi4 12.33, 13.2 ms a step without, 11.44, 12.6 ms with the o projection and gate|up so
 * fetched (q8_0: 18.81, 19.5 against 18.04, 18.65); 4096 bytes a tile, or the down projection and the next
 * layer's q|k|v as well, no better; on the f32 cache, whose attention is bound by memory, 9% slower, on f16
 * no faster (so only q8_0 and KIVI tiles fetch: kv_decode.h, kvc_cpu_kv_step_spare). */
#include "weight_hint.h"

#include <stdatomic.h>
#include <string.h>

#include "../../core/common.h"
#include "cpu.h"
#include "host.h"

static _Thread_local kvc_cpu_hint t_hint;
static atomic_int g_bytes = 2048;

void kvc_cpu_hint_weights(const kvc_view *w, int32_t n) {
    kvc_cpu_hint h = {{0}, {0}, 0};
    for (int32_t i = 0; i < n && h.k < KVC_HINT_RANGES; i++) {
        if (!w[i].buf || !w[i].buf->p) continue; /* (a layer without that weight: MoE's experts) */
        const char *p = kvc_hbuf_at(w[i], 0, 0), *end = (const char *)w[i].buf->p + w[i].buf->bytes;
        if (p >= end) continue;
        h.p[h.k] = p;
        h.n[h.k++] = (size_t)(end - p);
    }
    t_hint = h;
}

kvc_cpu_hint kvc_cpu_hint_take(void) {
    const kvc_cpu_hint h = t_hint;
    t_hint.k = 0;
    return h;
}

void kvc_cpu_hint_part(const kvc_cpu_hint *h, int64_t part, int64_t parts, kvc_cpu_hint_cursor *c) {
    size_t total = 0;
    for (int u = 0; u < h->k; u++) total += h->n[u];
    const size_t b0 = (size_t)((double)total * (double)part / (double)parts), b1 = (size_t)((double)total * (double)(part + 1) / (double)parts);
    memset(c, 0, sizeof *c);
    c->h = h;
    c->step = (size_t)atomic_load_explicit(&g_bytes, memory_order_relaxed);
    if (!c->step || b1 <= b0) return;
    size_t at = b0;
    while (c->u < h->k && at >= h->n[c->u]) at -= h->n[c->u++];
    c->off = at;
    c->left = b1 - b0;
}

void kvc_cpu_hint_fetch(kvc_cpu_hint_cursor *c) {
    size_t want = c->step < c->left ? c->step : c->left;
    c->left -= want;
    while (want && c->u < c->h->k) {
        const size_t n = c->h->n[c->u] - c->off < want ? c->h->n[c->u] - c->off : want;
        kvc_prefetch_lines_l2(c->h->p[c->u] + c->off, n);
        want -= n;
        c->off += n;
        if (c->off == c->h->n[c->u]) c->u++, c->off = 0;
    }
}

kvc_status kvc_cpu_set_weight_prefetch(int bytes) {
    if (bytes < 0 || bytes > 65536)
        return kvc_fail(KVC_ERR_ARG, "weight_prefetch: bytes a decode tile fetches of the next weights must be in [0, 65536] (0: none), got %d", bytes);
    atomic_store(&g_bytes, bytes);
    return KVC_OK;
}

int kvc_cpu_weight_prefetch(void) { return atomic_load(&g_bytes); }
