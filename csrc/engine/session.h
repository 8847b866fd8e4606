/* A session: one sequence being processed by a model: its KV cache, position counter, scratch
 * buffers and the press hook that acts during prefill. */
#ifndef KVC_SESSION_H
#define KVC_SESSION_H

#include "../backend/backend.h"
#include "../cache/kv_cache.h"
#include "../model/model.h"

/* What a press sees right after a layer's attention block during a forward pass. */
typedef struct kvc_layer_ctx {
    int32_t layer;
    int64_t n;               /* new tokens in this forward call */
    const int64_t *past_len; /* [Hkv] cache rows before this call's tokens were appended */
    const float *q;          /* [n, H*d] queries after RoPE */
    const float *attn;       /* [n, H*d] attention output before o_proj */
    const float *o;          /* [n, D] attention block output (after o_proj) */
    const float *resid;      /* [n, D] residual stream entering the attention block */
} kvc_layer_ctx;

struct kvc_session;
/* Called after each layer's attention block; may compact that layer's cache. */
typedef kvc_status (*kvc_layer_hook)(void *user, struct kvc_session *s, const kvc_layer_ctx *ctx);

struct kvc_session {
    kvc_model *model;
    const kvc_backend *be;
    kvc_cache cache;          /* the CPU cache (empty for a device session) */
    void *dev;                /* device session of the CUDA backend (its own ragged cache), or NULL */
    int64_t pos;              /* next token position */
    int64_t capacity_hint;
    int needs_reset;          /* a failed call left the cache inconsistent */
    double press_seconds;     /* wall time spent in the press hook since the last reset */
    /* scratch, grown on demand */
    float *buf;
    size_t buf_floats;
    int64_t *positions;
    size_t positions_cap;
    /* hook */
    kvc_layer_hook hook;
    void *hook_user;
    void (*hook_free)(void *user);
    /* kvc_forward_shared: sessions that receive this forward's K/V rows and run their own hook */
    struct kvc_session *const *followers;
    int32_t n_followers;
};

/* A session on the CPU backend even when the model also lives on the GPU (Judge Q training). */
kvc_status kvc_session_new_cpu(kvc_model *model, int64_t capacity_hint, kvc_session **out);

#endif
