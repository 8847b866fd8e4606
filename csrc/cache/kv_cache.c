/* Ragged KV cache: allocation, append, compaction. See kv_cache.h. */
#include <string.h>

#include "kv_cache.h"

kvc_status kvc_cache_init(kvc_cache *c, int32_t n_layers, int32_t n_kv, int32_t d) {
    memset(c, 0, sizeof *c);
    c->n_layers = n_layers;
    c->n_kv = n_kv;
    c->d = d;
    c->layers = calloc((size_t)n_layers, sizeof *c->layers);
    if (!c->layers) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache layer table");
    for (int32_t l = 0; l < n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        L->len = calloc((size_t)n_kv, sizeof *L->len);
        L->cap = calloc((size_t)n_kv, sizeof *L->cap);
        L->k = calloc((size_t)n_kv, sizeof *L->k);
        L->v = calloc((size_t)n_kv, sizeof *L->v);
        L->pos = calloc((size_t)n_kv, sizeof *L->pos);
        if (!L->len || !L->cap || !L->k || !L->v || !L->pos) {
            kvc_cache_free(c);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache head table");
        }
    }
    return KVC_OK;
}

static void layer_release(kvc_cache *c, kvc_layer_cache *L) {
    kvc_free(L->arena);
    c->bytes -= L->arena_bytes;
    L->arena = NULL;
    L->arena_bytes = 0;
}

void kvc_cache_free(kvc_cache *c) {
    if (!c->layers) return;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        kvc_free(L->arena);
        free(L->len);
        free(L->cap);
        free(L->k);
        free(L->v);
        free(L->pos);
    }
    free(c->layers);
    memset(c, 0, sizeof *c);
}

void kvc_cache_clear(kvc_cache *c) {
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        layer_release(c, L);
        for (int32_t h = 0; h < c->n_kv; h++) {
            L->len[h] = L->cap[h] = 0;
            L->k[h] = L->v[h] = NULL;
            L->pos[h] = NULL;
        }
    }
}

/* Bytes of one row of one head: K and V rows plus the position. */
static size_t row_bytes(const kvc_cache *c) { return 2 * (size_t)c->d * sizeof(float) + sizeof(int64_t); }

/* Allocate a new arena with capacity new_cap[h] per head, copy rows sel (or the first len rows when
 * sel is NULL) from the old arena, or from `from` (another cache's layer) when given, and swap it
 * in. Heads are laid out K | V | pos per head, each slice 64-byte aligned (d is a multiple of 16
 * floats in every supported model; positions follow). */
static kvc_status layer_repack(kvc_cache *c, int32_t layer, const int64_t *new_cap,
                               const int64_t *const *sel, const int64_t *n_sel, const kvc_layer_cache *from) {
    kvc_layer_cache *L = &c->layers[layer];
    const kvc_layer_cache *F = from ? from : L;
    const size_t d = (size_t)c->d;
    size_t total = 0;
    for (int32_t h = 0; h < c->n_kv; h++) {
        size_t b;
        if (kvc_mul_ok((size_t)new_cap[h], row_bytes(c), &b) || kvc_add_ok(total, b + 64 * 3, &total))
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache of %lld rows per head", (long long)new_cap[h]);
    }
    char *arena = kvc_malloc(total, "KV cache");
    if (!arena) return KVC_ERR_NOMEM;
    c->bytes += total;
    if (c->bytes > c->peak_bytes) c->peak_bytes = c->bytes;
    char *p = arena;
    for (int32_t h = 0; h < c->n_kv; h++) {
        const size_t cap = (size_t)new_cap[h];
        float *k = (float *)p;
        p += (cap * d * sizeof(float) + 63) & ~(size_t)63;
        float *v = (float *)p;
        p += (cap * d * sizeof(float) + 63) & ~(size_t)63;
        int64_t *pos = (int64_t *)p;
        p += (cap * sizeof(int64_t) + 63) & ~(size_t)63;
        const int64_t n = sel ? n_sel[h] : F->len[h];
        if (sel) {
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = sel[h][i];
                memcpy(k + i * d, F->k[h] + r * d, d * sizeof(float));
                memcpy(v + i * d, F->v[h] + r * d, d * sizeof(float));
                pos[i] = F->pos[h][r];
            }
        } else if (n > 0) {
            memcpy(k, F->k[h], (size_t)n * d * sizeof(float));
            memcpy(v, F->v[h], (size_t)n * d * sizeof(float));
            memcpy(pos, F->pos[h], (size_t)n * sizeof(int64_t));
        }
        L->k[h] = k;
        L->v[h] = v;
        L->pos[h] = pos;
        L->len[h] = n;
        L->cap[h] = (int64_t)cap;
    }
    void *old = L->arena;
    const size_t old_bytes = L->arena_bytes;
    L->arena = arena;
    L->arena_bytes = total;
    kvc_free(old);
    c->bytes -= old_bytes;
    return KVC_OK;
}

kvc_status kvc_cache_reserve(kvc_cache *c, int32_t layer, int64_t extra) {
    kvc_layer_cache *L = &c->layers[layer];
    int grow = 0;
    for (int32_t h = 0; h < c->n_kv; h++)
        if (L->len[h] + extra > L->cap[h]) grow = 1;
    if (!grow) return KVC_OK;
    int64_t stack_caps[64];
    int64_t *caps = c->n_kv <= 64 ? stack_caps : malloc(sizeof(int64_t) * c->n_kv);
    if (!caps) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    for (int32_t h = 0; h < c->n_kv; h++) {
        int64_t need = L->len[h] + extra;
        int64_t cap = L->cap[h];
        if (need > cap) {
            /* geometric growth (x1.5, at least 16 rows) so per-token appends are amortised O(1) */
            int64_t grown = cap + cap / 2;
            cap = need > grown ? need : grown;
            if (cap < 16) cap = 16;
        }
        caps[h] = cap;
    }
    kvc_status st = layer_repack(c, layer, caps, NULL, NULL, NULL);
    if (caps != stack_caps) free(caps);
    return st;
}

void kvc_cache_append(kvc_cache *c, int32_t layer, const float *k, const float *v, const int64_t *pos, int64_t n) {
    kvc_layer_cache *L = &c->layers[layer];
    const size_t d = (size_t)c->d, stride = (size_t)c->n_kv * d;
    for (int32_t h = 0; h < c->n_kv; h++) {
        float *kd = L->k[h] + (size_t)L->len[h] * d;
        float *vd = L->v[h] + (size_t)L->len[h] * d;
        int64_t *pd = L->pos[h] + L->len[h];
        for (int64_t i = 0; i < n; i++) {
            memcpy(kd + i * d, k + i * stride + h * d, d * sizeof(float));
            memcpy(vd + i * d, v + i * stride + h * d, d * sizeof(float));
            pd[i] = pos[i];
        }
        L->len[h] += n;
    }
}

kvc_status kvc_cache_compact(kvc_cache *c, int32_t layer, const int64_t *const *keep, const int64_t *n_keep,
                             int64_t reserve) {
    kvc_layer_cache *L = &c->layers[layer];
    if (reserve < 0) return kvc_fail(KVC_ERR_ARG, "negative reserve");
    int64_t stack_caps[64];
    int64_t *caps = c->n_kv <= 64 ? stack_caps : malloc(sizeof(int64_t) * c->n_kv);
    if (!caps) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < c->n_kv && st == KVC_OK; h++) {
        if (n_keep[h] < 0 || n_keep[h] > L->len[h]) {
            st = kvc_fail(KVC_ERR_ARG, "layer %d head %d: keeping %lld of %lld tokens", layer, h,
                          (long long)n_keep[h], (long long)L->len[h]);
            break;
        }
        for (int64_t i = 0; i < n_keep[h]; i++) {
            if (keep[h][i] < 0 || keep[h][i] >= L->len[h] || (i > 0 && keep[h][i] <= keep[h][i - 1])) {
                st = kvc_fail(KVC_ERR_ARG, "layer %d head %d: kept rows must be increasing and in range", layer, h);
                break;
            }
        }
        caps[h] = n_keep[h] + reserve;
    }
    if (st == KVC_OK) st = layer_repack(c, layer, caps, keep, n_keep, NULL);
    if (caps != stack_caps) free(caps);
    return st;
}

kvc_status kvc_cache_copy(kvc_cache *dst, const kvc_cache *src) {
    if (dst->n_layers != src->n_layers || dst->n_kv != src->n_kv || dst->d != src->d)
        return kvc_fail(KVC_ERR_ARG, "copying a KV cache between caches of different shapes");
    kvc_cache_clear(dst);
    kvc_status st = KVC_OK;
    for (int32_t l = 0; l < src->n_layers && st == KVC_OK; l++) {
        int64_t rows = 0;
        for (int32_t h = 0; h < src->n_kv; h++) rows += src->layers[l].len[h];
        if (rows > 0) st = layer_repack(dst, l, src->layers[l].len, NULL, NULL, &src->layers[l]);
    }
    if (st != KVC_OK) kvc_cache_clear(dst);
    return st;
}

kvc_status kvc_cache_truncate(kvc_cache *c, int32_t layer, const int64_t *new_len) {
    kvc_layer_cache *L = &c->layers[layer];
    for (int32_t h = 0; h < c->n_kv; h++)
        if (new_len[h] < 0 || new_len[h] > L->len[h])
            return kvc_fail(KVC_ERR_ARG, "cannot truncate layer %d head %d from %lld to %lld tokens", layer, h,
                            (long long)L->len[h], (long long)new_len[h]);
    for (int32_t h = 0; h < c->n_kv; h++) L->len[h] = new_len[h];
    return KVC_OK;
}
