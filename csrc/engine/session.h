/* A session: one sequence on a model's backend: its KV cache, position counter, activations, the
 * press slots and the decode graph. The engine's kvc_session_* functions (life cycle, position, cache,
 * slots, graphs) are in session.c; the forward passes (prefill, decode step, shared prefill, batched
 * decode) in forward.c; what a press may see of it (the door, core/press_i.h) in press_door.c. Only
 * engine/ includes this file: presses see kvc_session as an opaque type. */
#ifndef KVC_SESSION_H
#define KVC_SESSION_H

#include "../core/press_i.h"
#include "moe.h"

/* The activations of a forward call, buffers of the backend grown on demand. */
typedef struct kvc_act {
    int64_t rows, logit_rows;
    kvc_buf *x;      /* f32 [rows, D] residual stream */
    kvc_buf *xn;     /* [rows, D] normed */
    kvc_buf *qkv;    /* [rows, qd + 2 kd] */
    kvc_buf *att;    /* [rows, qd] */
    kvc_buf *o;      /* [rows, D] */
    kvc_buf *gu;     /* [min(rows, mlp_rows), 2F] */
    kvc_buf *logits; /* f32 [logit_rows, V] */
    kvc_buf *ids;    /* i32 [rows] */
    kvc_buf *pos;    /* i64 [rows] */
    kvc_buf *win;    /* i64 [max(rows, n_layers), Hkv] sliding-window starts (models with a window only) */
    kvc_moe_act moe; /* the experts' scratch (models with experts only; moe.c) */
    uint64_t generation; /* bumped whenever a buffer is replaced (a captured graph holds the old ones) */
} kvc_act;

/* An attached press (core/press_i.h). */
typedef struct kvc_press_slot {
    const kvc_press_vt *vt; /* NULL: empty */
    void *self;
} kvc_press_slot;

struct kvc_session {
    kvc_model *model;
    const kvc_backend *be;
    kvc_cache cache;
    int64_t pos;              /* next token position */
    int64_t capacity_hint;
    int needs_reset;          /* a failed call left the cache inconsistent */
    double press_seconds;     /* wall time spent in the presses' hooks since the last reset */
    kvc_act act;
    int64_t *positions;       /* host positions of this call's rows */
    size_t positions_cap;
    int64_t *win;             /* host sliding-window starts (as act.win), positions_cap x Hkv at least */
    size_t win_cap;
    kvc_press_slot slots[KVC_N_SLOTS]; /* the attached presses; a probe's hook while one runs (press_door.c) */
    /* kvc_forward_shared: sessions that receive this forward's K/V rows and run their own hook */
    struct kvc_session *const *followers;
    int32_t n_followers;
    /* decode steps replayed as a graph (backends with graphs; kvc_session_set_decode_graphs) */
    int graphs;
    kvc_graph *graph;
    uint64_t graph_generation; /* act.generation at the capture */
    int32_t graph_rope_long;   /* the capture's RoPE frequencies were LongRoPE's long ones */
    int64_t decodes_since_capture, graph_steps;
    char graph_error[256];     /* why the last capture or replay failed ("" if none) */
    int32_t press_scope;       /* KVC_PRESS_SCOPE_*: what a prefill press sees of a layer (press_scope.c) */
};

/* press_scope.c: a layer's prefill hooks (run) under the session's press scope: with KVC_PRESS_SCOPE_CALL the
 * rows held before the call are set aside while they run, then put back in front of what they kept (a probe's
 * hook, KVC_PRESS_SEES_ALL_ROWS, is not scoped). */
kvc_status kvc_scoped_hooks(kvc_session *s, const kvc_layer_ctx *ctx,
                            kvc_status (*run)(kvc_session *s, const kvc_layer_ctx *ctx));
/* hook with the first aside[h] rows of each head of the layer set aside (kvc_door_aside). */
kvc_status kvc_scope_aside(kvc_session *s, const kvc_layer_ctx *ctx, const int64_t *aside, kvc_layer_hook hook,
                           void *user);

/* forward.c */
/* Activations for n rows and logit_rows rows of logits (never shrinks, except after running out of memory). */
kvc_status kvc_act_reserve(kvc_session *s, int64_t n, int64_t logit_rows);
void kvc_act_free(kvc_session *s);
/* Position scratch for n rows. */
kvc_status kvc_positions_reserve(kvc_session *s, int64_t n);

#endif
