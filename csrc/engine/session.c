/* The engine's kvc_session_* functions: life cycle, position, the cache (lengths, rows, copy, truncation),
 * the press slots (attach/detach; what a press is and does lives in press/, whose session functions are
 * in its own files) and decode graphs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "session.h"
#include "../core/kv_type.h"

static int graphs_default(void) {
    const char *e = getenv("KVC_DECODE_GRAPHS");
    return e && !strcmp(e, "1");
}

/* A decode graph replays device work that reads its inputs from buffers; an MoE layer's routing is read on the host
 * (engine/moe.c), so such a model's decode steps run eagerly. */
#define MOE_NO_GRAPHS "mixture-of-experts layers group each token's experts on the host: decode steps run eagerly"


kvc_status kvc_session_new(kvc_model *model, int64_t capacity_hint, kvc_session **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: out is NULL");
    *out = NULL;
    if (!model) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: model is NULL");
    if (capacity_hint < 0) return kvc_fail(KVC_ERR_ARG, "capacity_hint must be >= 0");
    kvc_session *s = calloc(1, sizeof *s);
    if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: session");
    s->model = model;
    s->be = model->be;
    s->capacity_hint = capacity_hint;
    s->graphs = graphs_default() && model->cfg.n_experts == 0;
    if (graphs_default() && !s->graphs) snprintf(s->graph_error, sizeof s->graph_error, "%s", MOE_NO_GRAPHS);
    kvc_backend_lock(s->be);
    kvc_status st = kvc_cache_init(&s->cache, s->be, model->cfg.n_layers, model->cfg.n_kv_heads, model->cfg.head_dim,
                                   &model->kv_format);
    kvc_backend_unlock(s->be);
    if (st != KVC_OK) {
        free(s);
        return st;
    }
    *out = s;
    return KVC_OK;
}

void kvc_session_free(kvc_session *s) {
    if (!s) return;
    kvc_backend_lock(s->be);
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt && s->slots[i].vt->free) s->slots[i].vt->free(s->slots[i].self);
    if (s->graph) s->be->graph_free(s->graph);
    kvc_act_free(s);
    kvc_cache_free(&s->cache);
    kvc_backend_unlock(s->be);
    free(s->positions);
    free(s->win);
    free(s);
}

void kvc_session_reset(kvc_session *s) {
    if (!s) return;
    kvc_backend_lock(s->be);
    kvc_status st = kvc_cache_clear(&s->cache);
    kvc_backend_unlock(s->be);
    s->press_seconds = 0.0;
    s->pos = 0;
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt && s->slots[i].vt->reset) s->slots[i].vt->reset(s->slots[i].self);
    /* A clear that stopped partway leaves rows behind: the next forward must refuse, not attend to them. */
    s->needs_reset = st != KVC_OK;
}

int64_t kvc_session_position(const kvc_session *s) { return s ? s->pos : 0; }

kvc_status kvc_session_set_position(kvc_session *s, int64_t position) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0, got %lld", (long long)position);
    s->pos = position;
    return KVC_OK;
}

int64_t kvc_session_cache_len(const kvc_session *s, int32_t layer, int32_t h) {
    if (!s || layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv) return -1;
    return s->cache.layers[layer].len[h];
}

double kvc_session_press_seconds(const kvc_session *s) { return s ? s->press_seconds : 0.0; }
size_t kvc_session_cache_bytes(const kvc_session *s) { return s ? s->cache.bytes : 0; }
size_t kvc_session_peak_cache_bytes(const kvc_session *s) { return s ? s->cache.peak_bytes : 0; }

kvc_status kvc_session_truncate(kvc_session *s, const int64_t *new_len, int64_t position) {
    if (!s || !new_len) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0");
    const int32_t Hkv = s->cache.n_kv;
    for (int32_t l = 0; l < s->cache.n_layers; l++)
        for (int32_t h = 0; h < Hkv; h++)
            if (new_len[l * Hkv + h] < 0 || new_len[l * Hkv + h] > s->cache.layers[l].len[h])
                return kvc_fail(KVC_ERR_ARG, "layer %d head %d holds %lld tokens: cannot truncate to %lld", l, h,
                                (long long)s->cache.layers[l].len[h], (long long)new_len[l * Hkv + h]);
    kvc_backend_lock(s->be);
    kvc_status st = KVC_OK;
    for (int32_t l = 0; l < s->cache.n_layers && st == KVC_OK; l++) st = kvc_cache_truncate(&s->cache, l, new_len + l * Hkv);
    kvc_backend_unlock(s->be);
    if (st == KVC_OK) s->pos = position;
    return st;
}

kvc_status kvc_session_cache_positions(const kvc_session *s, int32_t layer, int32_t h, int64_t *out) {
    if (!s || !out) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const kvc_layer_cache *L = &s->cache.layers[layer];
    if (L->len[h] > 0) memcpy(out, L->pos[h], sizeof(int64_t) * (size_t)L->len[h]);
    return KVC_OK;
}

kvc_status kvc_session_cache_rows(const kvc_session *s, int32_t layer, int32_t h, float *k, float *v) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const kvc_layer_cache *L = &s->cache.layers[layer];
    if (L->len[h] == 0 || (!k && !v)) return KVC_OK;
    kvc_backend_lock(s->be);
    kvc_status st = s->be->kv_read(L->kv, h, 0, L->len[h], k, v);
    kvc_backend_unlock(s->be);
    return st;
}

kvc_status kvc_session_copy_cache(kvc_session *dst, const kvc_session *src) {
    if (!dst || !src) return kvc_fail(KVC_ERR_ARG, "kvc_session_copy_cache: session is NULL");
    if (dst == src) return kvc_fail(KVC_ERR_ARG, "copying a session's cache onto itself");
    if (dst->model != src->model) return kvc_fail(KVC_ERR_ARG, "the two sessions belong to different models");
    if (src->needs_reset) return kvc_fail(KVC_ERR_ARG, "the source session failed a call: reset() it first");
    if (dst->needs_reset || dst->pos != 0 || !kvc_cache_is_empty(&dst->cache))
        return kvc_fail(KVC_ERR_ARG, "the destination session is not empty: call reset() on it first");
    if (dst->graph && memcmp(&dst->cache.fmt, &src->cache.fmt, sizeof dst->cache.fmt)) { /* its stores change */
        dst->be->graph_free(dst->graph);
        dst->graph = NULL;
    }
    kvc_backend_lock(dst->be);
    kvc_status st = KVC_OK; /* an exact copy: the source's storage type too (dst is empty) */
    if (memcmp(&dst->cache.fmt, &src->cache.fmt, sizeof dst->cache.fmt)) st = kvc_cache_set_format(&dst->cache, &src->cache.fmt);
    if (st == KVC_OK) st = kvc_cache_copy(&dst->cache, &src->cache);
    kvc_backend_unlock(dst->be);
    if (st == KVC_OK) dst->pos = src->pos;
    return st;
}

/* ---- press slots (core/press_i.h) ---- */

kvc_status kvc_session_attach(kvc_session *s, int32_t which, const kvc_press_vt *vt, void *self) {
    if (!s || which < 0 || which >= KVC_N_SLOTS) { /* the slot owns self from here: a refused one is freed */
        if (vt && vt->free) vt->free(self);
        return s ? kvc_fail(KVC_ERR_ARG, "no press slot %d", which) : kvc_fail(KVC_ERR_ARG, "session is NULL");
    }
    kvc_press_slot *slot = &s->slots[which];
    kvc_backend_lock(s->be);
    if (slot->vt && slot->vt->free) slot->vt->free(slot->self);
    kvc_backend_unlock(s->be);
    slot->vt = vt;
    slot->self = vt ? self : NULL;
    return KVC_OK;
}

/* ---- decode graphs ---- */

kvc_status kvc_session_set_decode_graphs(kvc_session *s, int32_t on) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (on && !s->be->graph_capture)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "the %s backend has no graphs: decode steps run one kernel at a time",
                        s->be->name);
    if (on && s->model->cfg.n_experts > 0) return kvc_fail(KVC_ERR_UNSUPPORTED, "no decode graphs: %s", MOE_NO_GRAPHS);
    s->graphs = on != 0;
    if (on) s->graph_error[0] = '\0';
    return KVC_OK;
}

kvc_status kvc_session_graph_info(const kvc_session *s, int32_t *on, int64_t *graph_steps, const char **error) {
    if (!s || !on || !graph_steps || !error) return kvc_fail(KVC_ERR_ARG, "null argument");
    *on = s->graphs;
    *graph_steps = s->graph_steps;
    *error = s->graph_error;
    return KVC_OK;
}

/* ---- the K/V cache's storage type (core/kv_type.h) ---- */

kvc_status kvc_model_set_kv_format(kvc_model *model, const kvc_kv_format *format) {
    if (!model || !format) return kvc_fail(KVC_ERR_ARG, "kvc_model_set_kv_format: model or format is NULL");
    KVC_TRY(kvc_kv_format_check(format, model->cfg.head_dim));
    model->kv_format = *format;
    return KVC_OK;
}

void kvc_model_get_kv_format(const kvc_model *model, kvc_kv_format *out) {
    if (!out) return;
    out->type = KVC_KV_NATIVE;
    out->group = out->residual = 0;
    if (model) *out = model->kv_format;
}

kvc_status kvc_session_set_kv_format(kvc_session *s, const kvc_kv_format *format) {
    if (!s || !format) return kvc_fail(KVC_ERR_ARG, "kvc_session_set_kv_format: session or format is NULL");
    KVC_TRY(kvc_kv_format_check(format, s->model->cfg.head_dim));
    if (s->graph) { /* a captured decode reads the old stores */
        s->be->graph_free(s->graph);
        s->graph = NULL;
    }
    kvc_backend_lock(s->be);
    const kvc_status st = kvc_cache_set_format(&s->cache, format);
    kvc_backend_unlock(s->be);
    return st;
}

void kvc_session_get_kv_format(const kvc_session *s, kvc_kv_format *out) {
    if (!out) return;
    out->type = KVC_KV_NATIVE;
    out->group = out->residual = 0;
    if (!s) return;
    *out = s->cache.fmt;
    if (out->type == KVC_KV_NATIVE) out->type = s->be->act_dtype == KVC_BF16 ? KVC_KV_BF16 : KVC_KV_F32;
    if (!kvc_kv_type_key_blocks(out->type)) out->group = out->residual = 0;
}
