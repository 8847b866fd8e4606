/* A session's cache saved to a file and loaded back (the file: persist/cache_file.h): the engine's side,
 * which owns the session's cache and position. */
#include <stdio.h>
#include <string.h>

#include "../persist/cache_file.h"
#include "../persist/model_id.h"
#include "session.h"

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
    kvc_backend_lock(s->be);
    kvc_status st = kvc_cache_file_write(&s->cache, &s->model->cfg, digest, s->pos, attached, path, n_meta, keys, values);
    kvc_backend_unlock(s->be);
    return st;
}

kvc_status kvc_session_load(kvc_session *s, const char *path) {
    if (!s || !path) return kvc_fail(KVC_ERR_ARG, "kvc_session_load: session or path is NULL");
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
    st = kvc_cache_file_load(f, &s->model->cfg, digest, &s->cache, &pos);
    if (s->graph && memcmp(&had, &s->cache.fmt, sizeof had)) { /* the file's type: new stores, which a captured decode does not read */
        s->be->graph_free(s->graph);
        s->graph = NULL;
    }
    kvc_backend_unlock(s->be);
    kvc_cache_file_close(f);
    if (st == KVC_OK) s->pos = pos;
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
