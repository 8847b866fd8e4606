/* The interface between the engine and the presses: the engine includes only this of the press world,
 * and a press sees a session only through it.
 *   - kvc_layer_ctx: what a press sees right after a layer's attention;
 *   - kvc_press_vt: what the engine calls on an attached press (a slot holds {vt, self});
 *   - the door (engine/press_door.c): the session's model, backend, cache and position, the reset flag,
 *     and probes (a forward with a temporary layer hook in place of the attached presses).
 * struct kvc_session is defined in engine/session.h, which no press includes. */
#ifndef KVC_PRESS_I_H
#define KVC_PRESS_I_H

#include "../cache/kv_cache.h"
#include "../model/model.h"

/* What a layer hook sees right after a layer's attention block (views of the session's activations on its
 * backend; read them with be->download or hand them to kernels). */
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
} kvc_layer_ctx;

/* A layer hook of a probe (kvc_door_probe); may compact that layer's cache. */
typedef kvc_status (*kvc_layer_hook)(void *user, kvc_session *s, const kvc_layer_ctx *ctx);

/* Traits of a press, for the engine's choices. */
enum {
    KVC_PRESS_EAGER_DECODE = 1u << 0, /* its decode steps do host work between layers: no decode graphs */
    KVC_PRESS_EVERY_LAYER = 1u << 1,  /* its hooks see every layer, the ones the model does not press too (a probe) */
    KVC_PRESS_SEES_ALL_ROWS = 1u << 2, /* its hooks see every row of the layer whatever the session's press scope (a
                                          probe: its caller scopes it, kvc_door_aside) */
};

/* A press's state between calls (counters, buffered queries, score queues), as a saved cache keeps it (persist/:
 * the file's state.<slot>.<name> tensors): named one-dimensional arrays of KVC_I64 or KVC_F32 values. */
typedef struct kvc_state_io kvc_state_io;
/* Writing: array `name` of n values (copied). */
kvc_status kvc_state_put(kvc_state_io *io, const char *name, int32_t dtype, const void *data, int64_t n);
/* Reading: the count of array `name` into *n (-1 when the file has none); KVC_ERR_FORMAT when it is not a
 * one-dimensional array of dtype. */
kvc_status kvc_state_count(kvc_state_io *io, const char *name, int32_t dtype, int64_t *n);
/* Reading: its n values into out; KVC_ERR_FORMAT naming it when it is absent or holds another count. */
kvc_status kvc_state_get(kvc_state_io *io, const char *name, int32_t dtype, void *out, int64_t n);
/* Reading: whether the file holds any array under the current names (the slot's, the scope's). */
int kvc_state_present(const kvc_state_io *io);
/* Names from here on are `scope`.name (a part of a press); kvc_state_unscope(io, the value returned) ends it. */
size_t kvc_state_scope(kvc_state_io *io, const char *scope);
void kvc_state_unscope(kvc_state_io *io, size_t mark);
/* A state the file holds that the press refuses (its settings or the cache disagree): KVC_ERR_FORMAT with the
 * file's path and `what` (printf-style). */
kvc_status kvc_state_bad(kvc_state_io *io, const char *fmt, ...);

/* What the engine calls on an attached press. */
typedef struct kvc_press_vt {
    const char *name;
    uint32_t traits;
    /* after a layer's attention in a multi-token call (prefill), or NULL */
    kvc_status (*on_layer)(void *self, kvc_session *s, const kvc_layer_ctx *ctx);
    /* after a layer's attention in a call after the session's first, or NULL */
    kvc_status (*on_decode_layer)(void *self, kvc_session *s, const kvc_layer_ctx *ctx);
    void (*reset)(void *self); /* the session was reset, or NULL */
    void (*free)(void *self);  /* called with the backend locked */
    /* its state between calls into a saved cache, or NULL (it keeps none) */
    kvc_status (*save_state)(const void *self, kvc_state_io *io);
    /* the state a saved cache holds for it, read back into a press just attached, after the cache was loaded (s: the
     * session holding it); every value checked against the press's settings and the cache; or NULL */
    kvc_status (*load_state)(void *self, kvc_session *s, kvc_state_io *io);
} kvc_press_vt;

/* A session's press slots: a prefill press and a decoding press may act at once (PrefillDecodingPress).
 * In every call, the on_layer hooks run first (slot order), then the on_decode_layer ones. */
enum { KVC_SLOT_PREFILL, KVC_SLOT_DECODING, KVC_N_SLOTS };

/* ---- engine/session.c ---- */
/* Attach self (vt: its press; NULL vt: detach) to slot `which`; what the slot held is freed. */
/* The slot takes ownership of self: on a refusal it is freed through vt->free. */
kvc_status kvc_session_attach(kvc_session *s, int32_t which, const kvc_press_vt *vt, void *self);

/* ---- engine/press_door.c: the only way a press sees a session ---- */
const kvc_model *kvc_door_model(const kvc_session *s);
const kvc_backend *kvc_door_backend(const kvc_session *s);
/* Host fp32 weights of the session's model (kvc_model_host_weights). */
kvc_status kvc_door_host_weights(const kvc_session *s, const kvc_host_weights **out);
/* The session's cache: read, compact, evict, append through the cache's own API (cache/kv_cache.h). */
kvc_cache *kvc_door_cache(kvc_session *s);
int64_t kvc_door_position(const kvc_session *s);
/* Move the position (a whole-cache method that appended rows itself, RestoreKV). */
void kvc_door_set_position(kvc_session *s, int64_t pos);
int kvc_door_needs_reset(const kvc_session *s);
/* The cache is no longer consistent (a method failed after evicting): the next forward refuses until a reset. */
void kvc_door_request_reset(kvc_session *s);
/* Whether every layer and head holds exactly `position` rows (the full cache of the context). */
int kvc_door_holds_full_cache(const kvc_session *s);
/* The state of the press attached with vt (in any slot), or NULL. */
void *kvc_door_slot(const kvc_session *s, const kvc_press_vt *vt);
/* A forward of n ids then n_emb embedding rows over the session's cache (kvc_forward_ex's logits) with `hook`
 * after every layer's attention in place of the attached presses (neither the prefill nor the decoding press
 * runs). On success the position moves by `advance` rows from where it was (0: back where it was); on failure
 * it stays and the session needs a reset (the hook may have evicted rows). */
kvc_status kvc_door_probe(kvc_session *s, const int32_t *ids, int64_t n, const float *emb, int64_t n_emb,
                          kvc_layer_hook hook, void *user, int64_t logits_row, float *logits, int64_t advance);
/* The session's press scope (KVC_PRESS_SCOPE_*): what a whole-cache method that runs its own prefill compresses
 * of a session holding rows (TAKE: every row, or the rows its call appends). */
int32_t kvc_door_press_scope(const kvc_session *s);
/* hook on layer ctx->layer with the first aside[h] rows of each head set aside (aside[h] <= ctx->past_len[h]):
 * it sees the layer as if those rows were not there (its ctx's past_len less them) and may compact what it sees;
 * the rows set aside are put back in front of what it kept (engine/press_scope.c). */
kvc_status kvc_door_aside(kvc_session *s, const kvc_layer_ctx *ctx, const int64_t *aside, kvc_layer_hook hook,
                          void *user);

#endif
