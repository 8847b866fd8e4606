/* A press scoped to rows at the end of a layer (kvc_session_set_press_scope, KVC_PRESS_SCOPE_CALL; a whole-cache
 * method's own scope through the door, kvc_door_aside): for a layer's hooks the rows each head holds in front
 * (the rows held before the call, or before a method's first call: TAKE's turn) are set aside, so the press sees
 * the layer as after a prefill into an empty session (the one case every press handles), and they are put back
 * in front of what the press kept afterwards. A conversation compresses each turn's new rows this way and keeps
 * the earlier turns' cache as it was. The rows go through the host (kv_read, then kvc_cache_load_layer). */
#include <string.h>

#include "session.h"

kvc_status kvc_session_set_press_scope(kvc_session *s, int32_t scope) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (scope != KVC_PRESS_SCOPE_CACHE && scope != KVC_PRESS_SCOPE_CALL)
        return kvc_fail(KVC_ERR_ARG, "press scope must be KVC_PRESS_SCOPE_CACHE (0) or KVC_PRESS_SCOPE_CALL (1), got %d", scope);
    s->press_scope = scope;
    return KVC_OK;
}

int32_t kvc_session_press_scope(const kvc_session *s) { return s ? s->press_scope : KVC_PRESS_SCOPE_CACHE; }

/* One head's rows [r0, r0 + n) of a layer on the host: K, V (f32, [n, d]) and positions. */
typedef struct rows_out {
    int64_t n[KVC_MAX_KV_HEADS];
    int64_t *pos[KVC_MAX_KV_HEADS];
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS];
} rows_out;

static void rows_free(rows_out *r, int32_t Hkv) {
    for (int32_t h = 0; h < Hkv; h++) {
        free(r->pos[h]);
        free(r->k[h]);
    }
}

static kvc_status rows_read(const kvc_cache *c, int32_t l, const int64_t *r0, const int64_t *n, rows_out *r) {
    const kvc_layer_cache *L = &c->layers[l];
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < c->n_kv && st == KVC_OK; h++) {
        r->n[h] = n[h];
        r->pos[h] = malloc(sizeof(int64_t) * (size_t)(n[h] ? n[h] : 1));
        r->k[h] = malloc(sizeof(float) * (size_t)(n[h] ? n[h] : 1) * (size_t)c->d * 2);
        if (!r->pos[h] || !r->k[h]) {
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: setting earlier rows aside");
            break;
        }
        r->v[h] = r->k[h] + (size_t)n[h] * c->d;
        if (n[h] == 0) continue;
        memcpy(r->pos[h], L->pos[h] + r0[h], sizeof(int64_t) * (size_t)n[h]);
        st = c->be->kv_read(L->kv, h, r0[h], n[h], r->k[h], r->v[h]);
    }
    return st;
}

/* The layer again: the rows set aside (old, pruned prefix old_np with channels old_kidx) in front of what the
 * press kept. Rows with pruned key channels must stay a prefix under one channel set. */
static kvc_status put_back(kvc_cache *c, int32_t l, const rows_out *old, const int64_t *old_np, int32_t old_dk,
                           const int32_t *old_kidx) {
    const int32_t Hkv = c->n_kv, d = c->d;
    kvc_layer_cache *L = &c->layers[l];
    int64_t zero[KVC_MAX_KV_HEADS] = {0}, len[KVC_MAX_KV_HEADS], np[KVC_MAX_KV_HEADS];
    int new_pruned = 0, old_pruned = 0, old_all_pruned = 1;
    for (int32_t h = 0; h < Hkv; h++) {
        new_pruned |= L->dk > 0 && L->np[h] > 0;
        old_pruned |= old_dk > 0 && old_np[h] > 0;
        old_all_pruned &= old_np[h] == old->n[h];
    }
    const int same_channels = old_dk == L->dk && old_dk > 0 &&
                              memcmp(old_kidx, L->kidx, sizeof(int32_t) * (size_t)Hkv * (size_t)old_dk) == 0;
    if (new_pruned && (!old_all_pruned || (old_pruned && !same_channels)))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "layer %d: the press freed key channels of this call's rows, but the rows "
                        "held before keep other channels, and a cache holds one channel set for its pruned rows: "
                        "scope the press to the whole cache (a press that prunes channels prunes every row at once)", l);
    rows_out now = {0};
    kvc_status st = rows_read(c, l, zero, L->len, &now);
    int32_t dk = new_pruned ? L->dk : old_pruned ? old_dk : 0;
    int32_t *kidx = NULL;
    if (st == KVC_OK && dk > 0) {
        kidx = malloc(sizeof(int32_t) * (size_t)Hkv * (size_t)dk);
        if (!kidx) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: putting earlier rows back");
        else memcpy(kidx, new_pruned ? L->kidx : old_kidx, sizeof(int32_t) * (size_t)Hkv * (size_t)dk);
    }
    int64_t *pos[KVC_MAX_KV_HEADS] = {0};
    float *k[KVC_MAX_KV_HEADS] = {0}, *v[KVC_MAX_KV_HEADS] = {0};
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        len[h] = old->n[h] + now.n[h];
        np[h] = new_pruned ? old->n[h] + L->np[h] : old_pruned ? old_np[h] : 0;
        pos[h] = malloc(sizeof(int64_t) * (size_t)(len[h] ? len[h] : 1));
        k[h] = malloc(sizeof(float) * (size_t)(len[h] ? len[h] : 1) * (size_t)d * 2);
        if (!pos[h] || !k[h]) {
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: putting earlier rows back");
            break;
        }
        v[h] = k[h] + (size_t)len[h] * d;
        const size_t a = (size_t)old->n[h], b = (size_t)now.n[h];
        memcpy(pos[h], old->pos[h], sizeof(int64_t) * a);
        memcpy(pos[h] + a, now.pos[h], sizeof(int64_t) * b);
        memcpy(k[h], old->k[h], sizeof(float) * a * d);
        memcpy(k[h] + a * d, now.k[h], sizeof(float) * b * d);
        memcpy(v[h], old->v[h], sizeof(float) * a * d);
        memcpy(v[h] + a * d, now.v[h], sizeof(float) * b * d);
    }
    if (st == KVC_OK) st = kvc_cache_truncate(c, l, zero);
    if (st == KVC_OK)
        st = kvc_cache_load_layer(c, l, len, (const int64_t *const *)pos, (const float *const *)k, (const float *const *)v,
                                  dk, kidx, np);
    for (int32_t h = 0; h < Hkv; h++) {
        free(pos[h]);
        free(k[h]);
    }
    free(kidx);
    rows_free(&now, Hkv);
    return st;
}

kvc_status kvc_scope_aside(kvc_session *s, const kvc_layer_ctx *ctx, const int64_t *aside, kvc_layer_hook hook,
                           void *user) {
    kvc_cache *c = &s->cache;
    const int32_t l = ctx->layer, Hkv = c->n_kv;
    kvc_layer_cache *L = &c->layers[l];
    int64_t held = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        if (aside[h] < 0 || aside[h] > ctx->past_len[h])
            return kvc_fail(KVC_ERR_INTERNAL, "press scope: layer %d head %d sets %lld rows aside of the %lld held before "
                            "the call", l, h, (long long)aside[h], (long long)ctx->past_len[h]);
        held += aside[h];
    }
    if (held == 0) return hook(user, s, ctx);
    int64_t zero[KVC_MAX_KV_HEADS] = {0}, old_np[KVC_MAX_KV_HEADS], n_new[KVC_MAX_KV_HEADS], past[KVC_MAX_KV_HEADS];
    int64_t *keep[KVC_MAX_KV_HEADS] = {0};
    rows_out old = {0};
    const int32_t old_dk = L->dk;
    int32_t *old_kidx = NULL;
    kvc_status st = rows_read(c, l, zero, aside, &old);
    if (st == KVC_OK && old_dk > 0) {
        old_kidx = malloc(sizeof(int32_t) * (size_t)Hkv * (size_t)old_dk);
        if (!old_kidx) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: setting earlier rows aside");
        else memcpy(old_kidx, L->kidx, sizeof(int32_t) * (size_t)Hkv * (size_t)old_dk);
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        old_np[h] = L->np[h] < aside[h] ? L->np[h] : aside[h];
        n_new[h] = L->len[h] - aside[h];
        past[h] = ctx->past_len[h] - aside[h];
        keep[h] = malloc(sizeof(int64_t) * (size_t)(n_new[h] ? n_new[h] : 1));
        if (!keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: setting earlier rows aside");
        for (int64_t i = 0; keep[h] && i < n_new[h]; i++) keep[h][i] = aside[h] + i;
    }
    /* the layer holds the rows after the ones set aside only, as after a prefill into an empty session */
    const uint64_t before = c->compactions;
    if (st == KVC_OK) st = kvc_cache_compact(c, l, (const int64_t *const *)keep, n_new, 0);
    if (st == KVC_OK) {
        const uint64_t set_aside = c->compactions;
        kvc_layer_ctx alone = *ctx;
        alone.past_len = past;
        st = hook(user, s, &alone);
        const int evicted = c->compactions != set_aside;
        const kvc_status back = put_back(c, l, &old, old_np, old_dk, old_kidx);
        /* every row back where it was: a press that refused (before evicting) leaves a call that can be undone */
        if (back == KVC_OK && !evicted) c->compactions = before;
        if (st == KVC_OK) st = back;
    }
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    free(old_kidx);
    rows_free(&old, Hkv);
    return st;
}

typedef struct run_box { kvc_status (*run)(kvc_session *s, const kvc_layer_ctx *ctx); } run_box;

static kvc_status run_boxed(void *box, kvc_session *s, const kvc_layer_ctx *ctx) { return ((run_box *)box)->run(s, ctx); }

kvc_status kvc_scoped_hooks(kvc_session *s, const kvc_layer_ctx *ctx,
                            kvc_status (*run)(kvc_session *s, const kvc_layer_ctx *ctx)) {
    const kvc_press_vt *vt = s->slots[KVC_SLOT_PREFILL].vt;
    /* a probe's hook sees every row: its caller scopes it (kvc_door_aside) */
    if (s->press_scope != KVC_PRESS_SCOPE_CALL || (vt && (vt->traits & KVC_PRESS_SEES_ALL_ROWS))) return run(s, ctx);
    run_box box = {run};
    return kvc_scope_aside(s, ctx, ctx->past_len, run_boxed, &box);
}
