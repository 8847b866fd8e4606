/* The mixture-of-experts MLP of a layer (engine/moe.c): its activations and its forward. Only engine/ includes
 * this file (session.h holds the activations). */
#ifndef KVC_ENGINE_MOE_H
#define KVC_ENGINE_MOE_H

#include "../core/backend.h"

struct kvc_session;

/* A block of up to `rows` tokens' MoE scratch (models with experts only). */
typedef struct kvc_moe_act {
    int64_t rows;
    kvc_buf *logits; /* f32 [rows, E] the router's */
    kvc_buf *ids;    /* i32 [rows, k] each token's experts */
    kvc_buf *w;      /* f32 [rows, k] their weights */
    kvc_buf *map;    /* i32 [2 rows k]: the gathered rows' tokens (grouped by expert), then each (token, j)'s row */
    kvc_buf *xs;     /* [rows k, D] the gathered rows, each overwritten by its expert's output */
    kvc_buf *gu;     /* [rows, 2 moe_ffn] one expert's gate|up */
    int32_t *host;   /* host: ids [rows k], the map [2 rows k], per expert counts [E] and starts [E + 1] */
} kvc_moe_act;

/* Scratch for calls of n rows (a block of them at most); nothing for a model without experts. */
kvc_status kvc_moe_reserve(struct kvc_session *s, int64_t n);
void kvc_moe_release(struct kvc_session *s);
/* Layer l's MoE MLP on the session's `rows` normed rows (act.xn): their experts' outputs, weighted, added to x. */
kvc_status kvc_moe_mlp(struct kvc_session *s, int32_t l, int64_t rows);

#endif
