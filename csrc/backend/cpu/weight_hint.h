/* The weights a decode step reads after a layer's attention, fetched during that attention (weight_hint.c):
 * the CPU backend's hint_weights (core/backend.h). On a q8_0 or KIVI cache the decode attention is bound by its
 * arithmetic and reads its K/V at ~10 GB/s, under what one core can stream; the GEMVs after it are bound by
 * memory. Lines of the weights asked for into L2 a few per K/V tile (they then sit in L2 or L3 when the GEMV
 * reads them) move some of the GEMV's memory time under the attention's. Internal to the CPU backend. */
#ifndef KVC_CPU_WEIGHT_HINT_H
#define KVC_CPU_WEIGHT_HINT_H

#include <stddef.h>
#include <stdint.h>

#include "../../core/backend.h"

#define KVC_HINT_RANGES 4

/* byte ranges of host weights */
typedef struct kvc_cpu_hint {
    const char *p[KVC_HINT_RANGES];
    size_t n[KVC_HINT_RANGES];
    int k;
} kvc_cpu_hint;

/* a task's share of a hint, fetched `step` bytes at a time */
typedef struct kvc_cpu_hint_cursor {
    const kvc_cpu_hint *h;
    int u;            /* the range being fetched */
    size_t off, left; /* its next byte, and the share's bytes not yet asked for */
    size_t step;
} kvc_cpu_hint_cursor;

/* the backend's hint_weights: the calling thread's hint (replacing the one before) */
void kvc_cpu_hint_weights(const kvc_view *w, int32_t n);
/* the calling thread's hint, which is cleared (an attention takes it, used or not: never a stale one) */
kvc_cpu_hint kvc_cpu_hint_take(void);
/* cursor over bytes [total part / parts, total (part + 1) / parts) of h (its ranges end to end), `step`
 * (the weight_prefetch setting) at a time; step 0 or an empty hint: nothing is fetched */
void kvc_cpu_hint_part(const kvc_cpu_hint *h, int64_t part, int64_t parts, kvc_cpu_hint_cursor *c);
/* the cursor's next `step` bytes asked for into L2 */
void kvc_cpu_hint_fetch(kvc_cpu_hint_cursor *c);
/* The setting "weight_prefetch": bytes a decode tile of a q8_0 or KIVI cache asks for (0: none; default 2048).
 * KVC_ERR_ARG outside [0, 65536]. */
kvc_status kvc_cpu_set_weight_prefetch(int bytes);
int kvc_cpu_weight_prefetch(void);

#endif
