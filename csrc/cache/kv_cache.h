/* Ragged KV cache: every (layer, KV head) has its own length and capacity. The rows live in the
 * backend (one kvc_kv per layer: heads are [cap, d] slices of one arena, so attention reads each head
 * without padding to the longest); this file keeps the bookkeeping on the host, the same for every
 * device: lengths (mirrored to the backend), capacities, the original position of every row, bytes.
 * Appends grow a layer geometrically (amortised O(1) per token); compaction after eviction re-packs the
 * layer into an arena sized for what is kept, so the memory really drops. */
#ifndef KVC_KV_CACHE_H
#define KVC_KV_CACHE_H

#include "../core/backend.h"
#include "../core/common.h"

typedef struct kvc_layer_cache {
    kvc_kv *kv;     /* the backend's rows of this layer */
    int64_t *len;   /* [Hkv] rows held */
    int64_t *cap;   /* [Hkv] rows of room */
    int64_t **pos;  /* [Hkv] -> [cap] original token positions of the rows (one host allocation) */
    size_t bytes;   /* the arena plus the positions */
    /* ThinK's freed key channels, as the backend's store holds them (core/kv_layout.h's rules, mirrored
     * here so a saved cache can say which rows lost which channels): rows [0, np[h]) of head h keep only
     * the dk channels kidx[h dk ..]; dk 0 and kidx NULL when no row is pruned. */
    int64_t *np;    /* [Hkv] */
    int32_t dk;
    int32_t *kidx;  /* [Hkv dk] */
} kvc_layer_cache;

typedef struct kvc_cache {
    const kvc_backend *be;
    int32_t n_layers, n_kv, d;
    kvc_kv_format fmt; /* the stores' type (core/kv_type.h; KVC_KV_NATIVE: the backend's own) */
    kvc_layer_cache *layers;
    size_t bytes;      /* held now */
    size_t peak_bytes; /* most ever held at once (an old arena and its replacement together included) */
    uint64_t compactions; /* evictions so far: a call that fails after one cannot give the rows back */
} kvc_cache;

kvc_status kvc_cache_init(kvc_cache *c, const kvc_backend *be, int32_t n_layers, int32_t n_kv, int32_t d,
                          const kvc_kv_format *fmt);
/* New stores of type fmt for the empty cache c (KVC_ERR_ARG when it holds rows); on failure c keeps its own. */
kvc_status kvc_cache_set_format(kvc_cache *c, const kvc_kv_format *fmt);
/* After `layer`'s attention: the rows appended since into the stores' type (the backend's kv_commit). */
kvc_status kvc_cache_commit(kvc_cache *c, int32_t layer);
void kvc_cache_free(kvc_cache *c);
/* Drop every row of every layer (arenas freed). */
kvc_status kvc_cache_clear(kvc_cache *c);
/* Make room for `extra` more rows in every head of `layer` (geometric growth, one copy). */
kvc_status kvc_cache_reserve(kvc_cache *c, int32_t layer, int64_t extra);
/* Append n rows to every head of `layer`: K at columns kcol + h d and V at vcol + h d of the rows of
 * src (the q|k|v activations), at positions pos[n]. Room must have been reserved. */
kvc_status kvc_cache_append(kvc_cache *c, int32_t layer, kvc_view src, int64_t kcol, int64_t vcol, const int64_t *pos,
                            int64_t n);
/* Append n rows given on the host as f32 (K and V of head h at columns h d of k, v [n, Hkv d]) at positions pos[n],
 * through the backend's kv_write (rounded as the device stores them); room is reserved here. */
kvc_status kvc_cache_append_host(kvc_cache *c, int32_t layer, const float *k, const float *v, const int64_t *pos,
                                 int64_t n);
/* The host side of an append the backend already did (a replayed graph): lengths and positions. */
void kvc_cache_note_append(kvc_cache *c, int32_t layer, const int64_t *pos, int64_t n);
/* Keep, for each head h, rows keep[h][0 .. n_keep[h]) (strictly increasing), re-packed into an arena
 * with `reserve` spare rows per head. */
kvc_status kvc_cache_compact(kvc_cache *c, int32_t layer, const int64_t *const *keep, const int64_t *n_keep,
                             int64_t reserve);
/* ThinK: the keys of every row `layer` holds keep only the dk channels kidx[h dk ..] of head h, stored
 * that narrow (backend.h, kv_prune_keys); the layer's bytes drop. */
kvc_status kvc_cache_prune_keys(kvc_cache *c, int32_t layer, int32_t dk, const int32_t *kidx);
/* Make dst (same shape and backend) an exact copy of src, every arena sized to what src holds; on failure
 * dst is left empty. */
kvc_status kvc_cache_copy(kvc_cache *dst, const kvc_cache *src);
/* Cut every head of `layer` back to new_len[h] (<= current) rows; no reallocation. */
kvc_status kvc_cache_truncate(kvc_cache *c, int32_t layer, const int64_t *new_len);
/* Fill the empty `layer` with len[h] rows per head given on the host as f32: K k[h] and V v[h] ([len[h], d],
 * pruned rows with zeros in their dropped channels), positions pos[h]; rows [0, np[h]) then keep only the dk
 * channels kidx (dk 0: none), as kvc_cache_prune_keys leaves them. The arena holds exactly the rows. */
kvc_status kvc_cache_load_layer(kvc_cache *c, int32_t layer, const int64_t *len, const int64_t *const *pos,
                                const float *const *k, const float *const *v, int32_t dk, const int32_t *kidx,
                                const int64_t *np);
/* 1 when no head of any layer holds a row. */
int kvc_cache_is_empty(const kvc_cache *c);
/* Drop the rows at positions >= pos0 from layers [0, last] (a failed call loses nothing it appended). */
void kvc_cache_drop_from(kvc_cache *c, int32_t last, int64_t pos0);

#endif
