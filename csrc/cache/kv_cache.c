/* Ragged KV cache: the host bookkeeping of kv_cache.h over the backend's K/V stores. */
#include <string.h>

#include "kv_cache.h"
#include "../core/kv_layout.h"

kvc_status kvc_cache_init(kvc_cache *c, const kvc_backend *be, int32_t n_layers, int32_t n_kv, int32_t d,
                          const kvc_kv_format *fmt) {
    memset(c, 0, sizeof *c);
    c->be = be;
    c->n_layers = n_layers;
    c->n_kv = n_kv;
    c->d = d;
    c->fmt.type = KVC_KV_NATIVE;
    if (fmt) c->fmt = *fmt;
    c->layers = calloc((size_t)n_layers, sizeof *c->layers);
    if (!c->layers) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache layer table");
    for (int32_t l = 0; l < n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        L->len = calloc((size_t)n_kv, sizeof *L->len);
        L->cap = calloc((size_t)n_kv, sizeof *L->cap);
        L->pos = calloc((size_t)n_kv, sizeof *L->pos);
        L->np = calloc((size_t)n_kv, sizeof *L->np);
        if (!L->len || !L->cap || !L->pos || !L->np) {
            kvc_cache_free(c);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache head table");
        }
        kvc_status st = be->kv_new(n_kv, d, &c->fmt, &L->kv);
        if (st != KVC_OK) {
            kvc_cache_free(c);
            return st;
        }
    }
    return KVC_OK;
}

kvc_status kvc_cache_set_format(kvc_cache *c, const kvc_kv_format *fmt) {
    if (!kvc_cache_is_empty(c)) return kvc_fail(KVC_ERR_ARG, "the K/V cache type can change only while the cache is empty: reset the session first");
    KVC_TRY(kvc_cache_clear(c)); /* no room reserved in the old stores either */
    kvc_kv **fresh = calloc((size_t)c->n_layers, sizeof *fresh);
    if (!fresh) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    kvc_status st = KVC_OK;
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++) st = c->be->kv_new(c->n_kv, c->d, fmt, &fresh[l]);
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_kv *old = st == KVC_OK ? c->layers[l].kv : fresh[l];
        if (old) c->be->kv_free(old);
        if (st == KVC_OK) {
            c->layers[l].kv = fresh[l];
            c->bytes -= c->layers[l].bytes;
            c->layers[l].bytes = 0;
        }
    }
    free(fresh);
    if (st == KVC_OK) c->fmt = *fmt;
    return st;
}

void kvc_cache_free(kvc_cache *c) {
    if (!c->layers) return;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        if (L->kv) c->be->kv_free(L->kv);
        if (L->pos) kvc_free(L->pos[0]);
        free(L->len);
        free(L->cap);
        free(L->pos);
        free(L->np);
        free(L->kidx);
    }
    free(c->layers);
    memset(c, 0, sizeof *c);
}

/* Bytes of a layer with cap[h] rows per head: the backend's arena (as it is now) and the positions. */
static size_t layer_bytes(const kvc_cache *c, const kvc_layer_cache *L, const int64_t *cap) {
    size_t b = c->be->kv_bytes(L->kv);
    for (int32_t h = 0; h < c->n_kv; h++) b += (size_t)cap[h] * sizeof(int64_t);
    return b;
}

/* One positions allocation for the heads' capacities; heads point into it. */
static int64_t *positions_new(const kvc_cache *c, const int64_t *cap, int64_t **heads) {
    size_t rows = 0;
    for (int32_t h = 0; h < c->n_kv; h++) rows += (size_t)cap[h];
    int64_t *p = kvc_malloc(sizeof(int64_t) * (rows ? rows : 1), "KV cache positions");
    if (!p) return NULL;
    size_t o = 0;
    for (int32_t h = 0; h < c->n_kv; h++) {
        heads[h] = p + o;
        o += (size_t)cap[h];
    }
    return p;
}

/* No pruned row left: the plain layout again (as the backend's store does). */
static void pruned_settle(const kvc_cache *c, kvc_layer_cache *L) {
    for (int32_t h = 0; h < c->n_kv; h++)
        if (L->np[h] > 0) return;
    free(L->kidx);
    L->kidx = NULL;
    L->dk = 0;
}

/* The pruned prefix after the lengths were cut to len (kv_set_lens below it shrinks it). */
static void pruned_cut(const kvc_cache *c, kvc_layer_cache *L) {
    for (int32_t h = 0; h < c->n_kv; h++) L->np[h] = kvc_kv_resized_pruned(L->len[h], L->np[h]);
    pruned_settle(c, L);
}

/* The layer's new arena is allocated while the old one still exists: count both for the peak. */
static void account(kvc_cache *c, kvc_layer_cache *L, size_t new_bytes) {
    if (c->bytes + new_bytes > c->peak_bytes) c->peak_bytes = c->bytes + new_bytes;
    c->bytes = c->bytes - L->bytes + new_bytes;
    L->bytes = new_bytes;
}

/* Swap in new positions and capacities (the backend arena has been replaced already). */
static void adopt(kvc_cache *c, kvc_layer_cache *L, int64_t **npos, const int64_t *cap, const int64_t *len) {
    kvc_free(L->pos[0]); /* head 0 starts the one positions allocation */
    for (int32_t h = 0; h < c->n_kv; h++) {
        L->pos[h] = npos[h];
        L->cap[h] = cap[h];
        L->len[h] = len[h];
    }
}

kvc_status kvc_cache_clear(kvc_cache *c) {
    kvc_status st = KVC_OK;
    int64_t *zero = calloc((size_t)(c->n_kv > 0 ? c->n_kv : 1), sizeof *zero);
    if (!zero) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++) {
        kvc_layer_cache *L = &c->layers[l];
        if (L->bytes == 0) continue;
        st = c->be->kv_resize(L->kv, zero, zero, NULL);
        if (st != KVC_OK) break;
        kvc_free(L->pos[0]);
        for (int32_t h = 0; h < c->n_kv; h++) {
            L->pos[h] = NULL;
            L->len[h] = L->cap[h] = L->np[h] = 0;
        }
        pruned_settle(c, L);
        c->bytes -= L->bytes;
        L->bytes = 0;
    }
    free(zero);
    return st;
}

/* Re-pack layer l into cap[h] rows per head keeping rows [0, rows[h]) of layer l of src (c itself when
 * NULL): growth and copies. */
static kvc_status layer_resize(kvc_cache *c, int32_t l, const int64_t *cap, const int64_t *rows, const kvc_cache *src) {
    kvc_layer_cache *L = &c->layers[l];
    const kvc_layer_cache *F = src ? &src->layers[l] : L;
    const int copy_kidx = F != L && F->dk > 0; /* the source's pruned prefix goes along */
    int64_t **npos = calloc((size_t)c->n_kv, sizeof *npos);
    int32_t *kidx = copy_kidx ? malloc(sizeof(int32_t) * (size_t)c->n_kv * (size_t)F->dk) : NULL;
    if (!npos || (copy_kidx && !kidx) || !positions_new(c, cap, npos)) {
        free(npos);
        free(kidx);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    }
    kvc_status st = c->be->kv_resize(L->kv, cap, rows, src ? F->kv : NULL);
    if (st != KVC_OK) {
        kvc_free(npos[0]);
        free(npos);
        free(kidx);
        return st;
    }
    const size_t nb = layer_bytes(c, L, cap);
    for (int32_t h = 0; h < c->n_kv; h++)
        if (rows[h] > 0) memcpy(npos[h], F->pos[h], sizeof(int64_t) * (size_t)rows[h]);
    if (copy_kidx) {
        memcpy(kidx, F->kidx, sizeof(int32_t) * (size_t)c->n_kv * (size_t)F->dk);
        free(L->kidx);
        L->kidx = kidx;
        L->dk = F->dk;
    }
    for (int32_t h = 0; h < c->n_kv; h++) L->np[h] = kvc_kv_resized_pruned(rows[h], F->np[h]);
    pruned_settle(c, L);
    account(c, L, nb);
    adopt(c, L, npos, cap, rows);
    free(npos);
    return KVC_OK;
}

kvc_status kvc_cache_reserve(kvc_cache *c, int32_t layer, int64_t extra) {
    kvc_layer_cache *L = &c->layers[layer];
    int grow = 0;
    int64_t *nc = malloc(sizeof(int64_t) * (size_t)c->n_kv);
    if (!nc) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    for (int32_t h = 0; h < c->n_kv; h++) {
        const int64_t need = L->len[h] + extra;
        nc[h] = L->cap[h];
        if (need > L->cap[h]) {
            /* geometric growth: amortised O(1) copies per appended row */
            const int64_t g = L->cap[h] + L->cap[h] / 2;
            nc[h] = g > need ? g : need;
            if (nc[h] < 16) nc[h] = 16;
            grow = 1;
        }
    }
    kvc_status st = grow ? layer_resize(c, layer, nc, L->len, NULL) : KVC_OK;
    free(nc);
    return st;
}

void kvc_cache_note_append(kvc_cache *c, int32_t layer, const int64_t *pos, int64_t n) {
    kvc_layer_cache *L = &c->layers[layer];
    for (int32_t h = 0; h < c->n_kv; h++) {
        memcpy(L->pos[h] + L->len[h], pos, sizeof(int64_t) * (size_t)n);
        L->len[h] += n;
    }
    account(c, L, layer_bytes(c, L, L->cap)); /* rows waiting in f32 count until committed */
}

kvc_status kvc_cache_append(kvc_cache *c, int32_t layer, kvc_view src, int64_t kcol, int64_t vcol, const int64_t *pos,
                            int64_t n) {
    KVC_TRY(c->be->kv_append(c->layers[layer].kv, src, kcol, vcol, n));
    kvc_cache_note_append(c, layer, pos, n);
    return KVC_OK;
}

kvc_status kvc_cache_commit(kvc_cache *c, int32_t layer) {
    kvc_layer_cache *L = &c->layers[layer];
    KVC_TRY(c->be->kv_commit(L->kv));
    account(c, L, layer_bytes(c, L, L->cap));
    return KVC_OK;
}

kvc_status kvc_cache_append_host(kvc_cache *c, int32_t layer, const float *k, const float *v, const int64_t *pos,
                                 int64_t n) {
    kvc_layer_cache *L = &c->layers[layer];
    const int32_t Hkv = c->n_kv, d = c->d;
    KVC_TRY(kvc_cache_reserve(c, layer, n));
    float *hk = malloc(sizeof(float) * (size_t)n * d * 2), *hv = hk ? hk + (size_t)n * d : NULL;
    int64_t *len = malloc(sizeof(int64_t) * (size_t)Hkv);
    kvc_status st = hk && len ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V append");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) { /* head h's rows gathered, written after its last row */
        for (int64_t i = 0; i < n; i++) {
            memcpy(hk + i * d, k + (i * Hkv + h) * d, sizeof(float) * (size_t)d);
            memcpy(hv + i * d, v + (i * Hkv + h) * d, sizeof(float) * (size_t)d);
        }
        st = c->be->kv_write(L->kv, h, L->len[h], n, hk, hv);
        len[h] = L->len[h] + n;
    }
    if (st == KVC_OK) st = c->be->kv_set_lens(L->kv, len);
    if (st == KVC_OK) kvc_cache_note_append(c, layer, pos, n);
    if (st == KVC_OK) st = kvc_cache_commit(c, layer);
    free(hk);
    free(len);
    return st;
}

kvc_status kvc_cache_compact(kvc_cache *c, int32_t layer, const int64_t *const *keep, const int64_t *n_keep,
                             int64_t reserve) {
    kvc_layer_cache *L = &c->layers[layer];
    const int32_t Hkv = c->n_kv;
    for (int32_t h = 0; h < Hkv; h++) {
        if (n_keep[h] < 0 || n_keep[h] > L->len[h])
            return kvc_fail(KVC_ERR_INTERNAL, "compact: head %d keeps %lld of %lld rows", h, (long long)n_keep[h],
                            (long long)L->len[h]);
        for (int64_t i = 0; i < n_keep[h]; i++)
            if (keep[h][i] < 0 || keep[h][i] >= L->len[h] || (i > 0 && keep[h][i] <= keep[h][i - 1]))
                return kvc_fail(KVC_ERR_INTERNAL, "compact: head %d row list is not strictly increasing inside [0, %lld)",
                                h, (long long)L->len[h]);
    }
    const size_t nh = (size_t)(Hkv > 0 ? Hkv : 1);
    int64_t *cap = malloc(sizeof(int64_t) * nh);
    int64_t **npos = calloc(nh, sizeof *npos);
    kvc_status st = (!cap || !npos) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache compaction") : KVC_OK;
    if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) cap[h] = n_keep[h] + (reserve > 0 ? reserve : 0);
        if (!positions_new(c, cap, npos)) st = KVC_ERR_NOMEM;
    }
    if (st == KVC_OK) {
        st = c->be->kv_gather(L->kv, keep, n_keep, cap);
        if (st != KVC_OK) {
            kvc_free(npos[0]);
        } else {
            const size_t nb = layer_bytes(c, L, cap);
            for (int32_t h = 0; h < Hkv; h++) {
                for (int64_t i = 0; i < n_keep[h]; i++) npos[h][i] = L->pos[h][keep[h][i]];
                L->np[h] = kvc_kv_gathered_pruned(keep[h], n_keep[h], L->np[h]);
            }
            pruned_settle(c, L);
            account(c, L, nb);
            adopt(c, L, npos, cap, n_keep);
            c->compactions++;
        }
    }
    free(cap);
    free(npos);
    return st;
}

kvc_status kvc_cache_prune_keys(kvc_cache *c, int32_t layer, int32_t dk, const int32_t *kidx) {
    kvc_layer_cache *L = &c->layers[layer];
    int32_t *mine = malloc(sizeof(int32_t) * (size_t)c->n_kv * (size_t)(dk > 0 ? dk : 1));
    if (!mine) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache key channels");
    kvc_status st = c->be->kv_prune_keys(L->kv, dk, kidx);
    if (st != KVC_OK) {
        free(mine);
        return st;
    }
    memcpy(mine, kidx, sizeof(int32_t) * (size_t)c->n_kv * (size_t)dk);
    free(L->kidx);
    L->kidx = mine;
    L->dk = dk;
    for (int32_t h = 0; h < c->n_kv; h++) L->np[h] = L->len[h]; /* every row held */
    pruned_settle(c, L);
    account(c, L, layer_bytes(c, L, L->cap));
    c->compactions++; /* the dropped channels cannot come back either */
    return KVC_OK;
}

kvc_status kvc_cache_copy(kvc_cache *dst, const kvc_cache *src) {
    kvc_status st = kvc_cache_clear(dst);
    for (int32_t l = 0; l < dst->n_layers && st == KVC_OK; l++) {
        const int64_t *len = src->layers[l].len;
        int64_t rows = 0;
        for (int32_t h = 0; h < src->n_kv; h++) rows += len[h];
        if (rows > 0) st = layer_resize(dst, l, len, len, src);
    }
    if (st != KVC_OK) kvc_cache_clear(dst);
    return st;
}

kvc_status kvc_cache_truncate(kvc_cache *c, int32_t layer, const int64_t *new_len) {
    kvc_layer_cache *L = &c->layers[layer];
    for (int32_t h = 0; h < c->n_kv; h++)
        if (new_len[h] < 0 || new_len[h] > L->len[h])
            return kvc_fail(KVC_ERR_ARG, "truncate: head %d holds %lld rows, cannot keep %lld", h, (long long)L->len[h],
                            (long long)new_len[h]);
    KVC_TRY(c->be->kv_set_lens(L->kv, new_len));
    for (int32_t h = 0; h < c->n_kv; h++) L->len[h] = new_len[h];
    pruned_cut(c, L);
    account(c, L, layer_bytes(c, L, L->cap)); /* cutting into ThinK-pruned rows rebuilds the arena */
    return KVC_OK;
}

int kvc_cache_is_empty(const kvc_cache *c) {
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t h = 0; h < c->n_kv; h++)
            if (c->layers[l].len[h] != 0) return 0;
    return 1;
}

void kvc_cache_drop_from(kvc_cache *c, int32_t last, int64_t pos0) {
    for (int32_t l = 0; l <= last && l < c->n_layers; l++) {
        kvc_layer_cache *L = &c->layers[l];
        for (int32_t h = 0; h < c->n_kv; h++)
            while (L->len[h] > 0 && L->pos[h][L->len[h] - 1] >= pos0) L->len[h]--;
        c->be->kv_set_lens(L->kv, L->len); /* the host lengths are the truth; the device follows */
        pruned_cut(c, L);
        account(c, L, layer_bytes(c, L, L->cap));
    }
}

kvc_status kvc_cache_load_layer(kvc_cache *c, int32_t layer, const int64_t *len, const int64_t *const *pos,
                                const float *const *k, const float *const *v, int32_t dk, const int32_t *kidx,
                                const int64_t *np) {
    kvc_layer_cache *L = &c->layers[layer];
    const int32_t Hkv = c->n_kv;
    for (int32_t h = 0; h < Hkv; h++)
        if (L->len[h] != 0) return kvc_fail(KVC_ERR_ARG, "loading rows into layer %d, which holds rows already", layer);
    int64_t *zero = calloc((size_t)(Hkv > 0 ? Hkv : 1), sizeof *zero);
    if (!zero) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KV cache");
    kvc_status st = layer_resize(c, layer, len, zero, NULL); /* room for exactly the rows, none held yet */
    free(zero);
    int pruned = 0;
    for (int32_t h = 0; h < Hkv; h++) pruned |= dk > 0 && np[h] > 0;
    /* the pruned prefix first, pruned as ThinK left it; then the full rows after it */
    for (int32_t h = 0; h < Hkv && st == KVC_OK && pruned; h++)
        if (np[h] > 0) st = c->be->kv_write(L->kv, h, 0, np[h], k[h], v[h]);
    if (st == KVC_OK && pruned) st = c->be->kv_set_lens(L->kv, np);
    if (st == KVC_OK && pruned) {
        for (int32_t h = 0; h < Hkv; h++) L->len[h] = np[h];
        st = kvc_cache_prune_keys(c, layer, dk, kidx);
        c->compactions--; /* a load, not an eviction */
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t r0 = pruned ? np[h] : 0, d = c->d;
        if (len[h] > r0) st = c->be->kv_write(L->kv, h, r0, len[h] - r0, k[h] + r0 * d, v[h] + r0 * d);
    }
    if (st == KVC_OK) st = c->be->kv_set_lens(L->kv, len);
    if (st == KVC_OK)
        for (int32_t h = 0; h < Hkv; h++) {
            if (len[h] > 0) memcpy(L->pos[h], pos[h], sizeof(int64_t) * (size_t)len[h]);
            L->len[h] = len[h];
        }
    if (st == KVC_OK) st = kvc_cache_commit(c, layer);
    return st;
}
