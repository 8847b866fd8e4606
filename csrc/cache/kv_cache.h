/* Ragged KV cache: every (layer, KV head) has its own length and capacity. A layer's K, V and
 * original positions live in one arena; heads are contiguous [cap, d] slices of it, so attention
 * reads each head without padding to the longest. Appends grow a layer geometrically (amortised O(1)
 * per token); compaction after eviction re-packs the layer into an arena sized for what is kept, so
 * the memory really drops. */
#ifndef KVC_KV_CACHE_H
#define KVC_KV_CACHE_H

#include "../core/common.h"

typedef struct kvc_layer_cache {
    void *arena;       /* one allocation: K, V (float) and positions (int64) for every head */
    size_t arena_bytes;
    int64_t *len;      /* [Hkv] tokens held */
    int64_t *cap;      /* [Hkv] rows available */
    float **k;         /* [Hkv] -> [cap, d] */
    float **v;         /* [Hkv] -> [cap, d] */
    int64_t **pos;     /* [Hkv] -> [cap] original token positions of the rows */
} kvc_layer_cache;

typedef struct kvc_cache {
    int32_t n_layers, n_kv, d;
    kvc_layer_cache *layers;
    size_t bytes;      /* arenas allocated now */
    size_t peak_bytes; /* most ever allocated at once (transient copies included) */
} kvc_cache;

kvc_status kvc_cache_init(kvc_cache *c, int32_t n_layers, int32_t n_kv, int32_t d);
void kvc_cache_free(kvc_cache *c);
/* Drop every token of every layer (arenas freed). */
void kvc_cache_clear(kvc_cache *c);
/* Make room for `extra` more rows in every head of `layer` (geometric growth, one copy). */
kvc_status kvc_cache_reserve(kvc_cache *c, int32_t layer, int64_t extra);
/* Append n tokens: k and v are [n, n_kv * d] (projection output layout), positions pos[n].
 * Room must have been reserved. */
void kvc_cache_append(kvc_cache *c, int32_t layer, const float *k, const float *v, const int64_t *pos, int64_t n);
/* Keep, for each head h, rows keep[h][0 .. n_keep[h]) (strictly increasing row indices), and re-pack
 * the layer into an arena with `reserve` spare rows per head. */
kvc_status kvc_cache_compact(kvc_cache *c, int32_t layer, const int64_t *const *keep, const int64_t *n_keep,
                             int64_t reserve);
/* Make dst (same shape) an exact copy of src, every arena sized to what src holds; on failure dst is
 * left empty. */
kvc_status kvc_cache_copy(kvc_cache *dst, const kvc_cache *src);
/* Cut every head of `layer` back to len[h] = new_len[h] (<= current length); no reallocation. */
kvc_status kvc_cache_truncate(kvc_cache *c, int32_t layer, const int64_t *new_len);

#endif
