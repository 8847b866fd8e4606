/* A session: one sequence on a model's backend: its KV cache, position counter, activations, the
 * press attached to it and the decode graph. Every kvc_session_* function is in session.c; the forward
 * passes (prefill, decode step, shared prefill, batched decode) in forward.c. */
#ifndef KVC_SESSION_H
#define KVC_SESSION_H

#include "../cache/kv_cache.h"
#include "../model/model.h"

/* What a layer hook sees right after a layer's attention block of a multi-token forward (views of the
 * session's activations on its backend; read them with be->download or hand them to kernels). */
typedef struct kvc_layer_ctx {
    int32_t layer;
    int64_t n;               /* rows of this forward call */
    const int64_t *past_len; /* [Hkv] rows each head held before this call's rows were appended */
    kvc_view q;              /* [n, H*d] queries after RoPE (the q columns of the q|k|v rows) */
    kvc_view attn;           /* [n, H*d] attention output before o_proj */
    kvc_view o;              /* [n, D] attention block output (after o_proj) */
    kvc_view resid;          /* [n, D] f32 residual stream entering the block */
    const int64_t *pos;      /* host [n] positions of this call's rows; NULL: past_len[0] + i */
    kvc_view xn;             /* [n, D] the block's normed input (buf NULL where not given) */
    int64_t future_from;     /* ExpectedAttention's first future position; 0: the one after the last row */
} kvc_layer_ctx;

struct kvc_session;
/* Called after each layer's attention block of a multi-token forward; may compact that layer's cache. */
typedef kvc_status (*kvc_layer_hook)(void *user, struct kvc_session *s, const kvc_layer_ctx *ctx);

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
    uint64_t generation; /* bumped whenever a buffer is replaced (a captured graph holds the old ones) */
} kvc_act;

struct kvc_press;
struct kvc_decoding;

struct kvc_session {
    kvc_model *model;
    const kvc_backend *be;
    kvc_cache cache;
    int64_t pos;              /* next token position */
    int64_t capacity_hint;
    int needs_reset;          /* a failed call left the cache inconsistent */
    double press_seconds;     /* wall time spent in the layer hook since the last reset */
    kvc_act act;
    int64_t *positions;       /* host positions of this call's rows */
    size_t positions_cap;
    int64_t *win;             /* host sliding-window starts (as act.win), positions_cap x Hkv at least */
    size_t win_cap;
    struct kvc_press *press;  /* the attached press (press/schedule.c), or NULL */
    struct kvc_decoding *decoding; /* the attached decoding press (press/decoding.c), or NULL */
    kvc_layer_hook hook;      /* the hook a forward calls: the press's, or TAKE's or Judge Q's while they run */
    void *hook_user;
    /* kvc_forward_shared: sessions that receive this forward's K/V rows and run their own hook */
    struct kvc_session *const *followers;
    int32_t n_followers;
    /* decode steps replayed as a graph (backends with graphs; kvc_session_set_decode_graphs) */
    int graphs;
    kvc_graph *graph;
    uint64_t graph_generation; /* act.generation at the capture */
    int64_t decodes_since_capture, graph_steps;
    char graph_error[256];     /* why the last capture or replay failed ("" if none) */
};

/* forward.c */
/* Activations for n rows and logit_rows rows of logits (never shrinks, except after running out of memory). */
kvc_status kvc_act_reserve(kvc_session *s, int64_t n, int64_t logit_rows);
void kvc_act_free(kvc_session *s);
/* Position scratch for n rows. */
kvc_status kvc_positions_reserve(kvc_session *s, int64_t n);

#endif
