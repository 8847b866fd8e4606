/* A session's cache saved to a file and loaded back (the file: persist/cache_file.h): the engine's side,
 * which owns the session's cache, its position and the attached presses, whose state between calls (a decoding
 * press's counters and buffers mid-answer) rides along through their save_state / load_state hooks. */
#include <stdio.h>
#include <string.h>

#include "../core/kv_type.h"
#include "../persist/cache_file.h"
#include "../persist/model_id.h"
#include "../persist/press_state.h"
#include "session.h"

/* Every attached press's state, slot by slot (state.<its name>.*). */
static kvc_status save_states(const kvc_session *s, kvc_state_io *io) {
    for (int32_t i = 0; i < KVC_N_SLOTS; i++) {
        const kvc_press_slot *slot = &s->slots[i];
        if (!slot->vt || !slot->vt->save_state) continue;
        KVC_TRY(kvc_state_slot(io, slot->vt->name));
        KVC_TRY(slot->vt->save_state(slot->self, io));
    }
    return KVC_OK;
}

/* The state the file holds for each press attached now, read into it (a press the file holds none for keeps its
 * fresh state; a state for a press not attached is the caller's to refuse: kvc.presses names them). */
static kvc_status load_states(kvc_session *s, const kvc_cache_file *f) {
    kvc_state_io io;
    KVC_TRY(kvc_cache_file_state(f, &io));
    kvc_status st = KVC_OK;
    for (int32_t i = 0; i < KVC_N_SLOTS && st == KVC_OK; i++) {
        const kvc_press_slot *slot = &s->slots[i];
        if (!slot->vt) continue;
        st = kvc_state_slot(&io, slot->vt->name);
        if (st != KVC_OK || !kvc_state_present(&io)) continue;
        if (!slot->vt->load_state)
            st = kvc_fail(KVC_ERR_FORMAT, "'%s' holds a state for the %s press, which keeps none (a newer file?)", io.path,
                          slot->vt->name);
        if (st == KVC_OK) st = slot->vt->load_state(slot->self, s, &io);
        if (st == KVC_OK) st = kvc_state_all_read(&io);
    }
    kvc_state_io_free(&io);
    return st;
}

kvc_status kvc_session_save(kvc_session *s, const char *path, int32_t n_meta, const char *const *keys,
                            const char *const *values) {
    if (!s || !path) return kvc_fail(KVC_ERR_ARG, "kvc_session_save: session or path is NULL");
    if (s->needs_reset) return kvc_fail(KVC_ERR_ARG, "the session failed a call: its cache is not one to save (reset() it)");
    char attached[64] = ""; /* the presses attached now, by name: a load says when it cannot restore one */
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt)
            snprintf(attached + strlen(attached), sizeof attached - strlen(attached), "%s%s", attached[0] ? "," : "",
                     s->slots[i].vt->name);
    char digest[72]; /* before the backend lock: the model's own lock is taken for it */
    KVC_TRY(kvc_model_id_digest(s->model, digest));
    kvc_state_io io;
    kvc_state_writer_init(&io);
    kvc_status st = save_states(s, &io);
    kvc_backend_lock(s->be);
    if (st == KVC_OK)
        st = kvc_cache_file_write(&s->cache, &s->model->cfg, digest, s->pos, attached, &io, path, n_meta, keys, values);
    kvc_backend_unlock(s->be);
    kvc_state_io_free(&io);
    return st;
}

kvc_status kvc_session_load(kvc_session *s, const char *path) { return kvc_session_load_as(s, path, NULL); }

kvc_status kvc_session_load_as(kvc_session *s, const char *path, const kvc_kv_format *as) {
    if (!s || !path) return kvc_fail(KVC_ERR_ARG, "kvc_session_load: session or path is NULL");
    if (as) KVC_TRY(kvc_kv_format_check(as, s->model->cfg.head_dim));
    if (s->needs_reset || s->pos != 0 || !kvc_cache_is_empty(&s->cache))
        return kvc_fail(KVC_ERR_ARG, "loading a saved cache needs an empty session: call reset() on it first");
    kvc_cache_file *f = NULL;
    KVC_TRY(kvc_cache_file_open(path, &f));
    char digest[72]; /* before the backend lock: the model's own lock is taken for it */
    kvc_status st = kvc_model_id_digest(s->model, digest);
    int64_t pos = 0;
    if (st != KVC_OK) {
        kvc_cache_file_close(f);
        return st;
    }
    const kvc_kv_format had = s->cache.fmt;
    kvc_backend_lock(s->be);
    if (s->graph) { /* a load may build new stores (another type, or back to this one after a failure), which a
                     * captured decode does not read; the session is empty: nothing to keep */
        s->be->graph_free(s->graph);
        s->graph = NULL;
    }
    st = kvc_cache_file_load(f, &s->model->cfg, digest, as, &s->cache, &pos);
    kvc_backend_unlock(s->be);
    if (st == KVC_OK) {
        s->pos = pos; /* the presses check their state against the cache and position loaded */
        st = load_states(s, f);
        if (st != KVC_OK) { /* a state refused: the session goes back to empty, in its own type, its presses afresh */
            kvc_backend_lock(s->be);
            kvc_cache_clear(&s->cache);
            if (memcmp(&had, &s->cache.fmt, sizeof had)) kvc_cache_set_format(&s->cache, &had);
            if (s->graph) {
                s->be->graph_free(s->graph);
                s->graph = NULL;
            }
            kvc_backend_unlock(s->be);
            s->pos = 0;
            for (int32_t i = 0; i < KVC_N_SLOTS; i++)
                if (s->slots[i].vt && s->slots[i].vt->reset) s->slots[i].vt->reset(s->slots[i].self);
        }
    }
    kvc_cache_file_close(f);
    return st;
}

kvc_status kvc_cache_file_metadata(const char *path, char *out, size_t cap, size_t *needed) {
    kvc_cache_file *f = NULL;
    KVC_TRY(kvc_cache_file_open(path, &f));
    kvc_status st = kvc_cache_file_meta_json(f, out, cap, needed);
    kvc_cache_file_close(f);
    return st;
}

kvc_status kvc_model_digest(kvc_model *model, char *out, size_t cap) {
    if (!model || !out || cap < 72) return kvc_fail(KVC_ERR_ARG, "kvc_model_digest: model is NULL or out holds < 72 bytes");
    return kvc_model_id_digest(model, out);
}
