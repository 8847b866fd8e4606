/* The door (core/press_i.h): what a press may see of a session and do with it. Presses never read the
 * session's fields; whatever they need of it goes through these functions. */
#include <string.h>

#include "session.h"

const kvc_model *kvc_door_model(const kvc_session *s) { return s->model; }
const kvc_backend *kvc_door_backend(const kvc_session *s) { return s->be; }
kvc_status kvc_door_host_weights(const kvc_session *s, const kvc_host_weights **out) {
    return kvc_model_host_weights(s->model, out);
}
kvc_cache *kvc_door_cache(kvc_session *s) { return &s->cache; }
int64_t kvc_door_position(const kvc_session *s) { return s->pos; }
void kvc_door_set_position(kvc_session *s, int64_t pos) { s->pos = pos; }
int kvc_door_needs_reset(const kvc_session *s) { return s->needs_reset; }
void kvc_door_request_reset(kvc_session *s) { s->needs_reset = 1; }

int kvc_door_holds_full_cache(const kvc_session *s) {
    for (int32_t l = 0; l < s->cache.n_layers; l++)
        for (int32_t h = 0; h < s->cache.n_kv; h++)
            if (s->cache.layers[l].len[h] != s->pos) return 0;
    return 1;
}

void *kvc_door_slot(const kvc_session *s, const kvc_press_vt *vt) {
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (vt && s->slots[i].vt == vt) return s->slots[i].self;
    return NULL;
}

/* A probe's hook, run as the only press of the session while the probe's forward runs. */
typedef struct probe_hook {
    kvc_layer_hook hook;
    void *user;
} probe_hook;

static kvc_status probe_on_layer(void *self, kvc_session *s, const kvc_layer_ctx *ctx) {
    const probe_hook *p = self;
    return p->hook(p->user, s, ctx);
}

static const kvc_press_vt probe_vt = {.name = "probe", .traits = KVC_PRESS_EVERY_LAYER | KVC_PRESS_SEES_ALL_ROWS,
                                      .on_layer = probe_on_layer};

kvc_status kvc_door_probe(kvc_session *s, const int32_t *ids, int64_t n, const float *emb, int64_t n_emb,
                          kvc_layer_hook hook, void *user, int64_t logits_row, float *logits, int64_t advance) {
    if (!s || !hook) return kvc_fail(KVC_ERR_ARG, "probe: null argument");
    kvc_press_slot saved[KVC_N_SLOTS];
    memcpy(saved, s->slots, sizeof saved);
    probe_hook ph = {hook, user};
    memset(s->slots, 0, sizeof s->slots);
    s->slots[KVC_SLOT_PREFILL] = (kvc_press_slot){&probe_vt, &ph};
    const int64_t pos0 = s->pos;
    const kvc_status st = kvc_forward_ex(s, ids, n, emb, n_emb, logits_row, logits);
    memcpy(s->slots, saved, sizeof saved);
    if (st == KVC_OK) s->pos = pos0 + advance;
    else s->needs_reset = 1;
    return st;
}

int32_t kvc_door_press_scope(const kvc_session *s) { return s->press_scope; }

kvc_status kvc_door_aside(kvc_session *s, const kvc_layer_ctx *ctx, const int64_t *aside, kvc_layer_hook hook,
                          void *user) {
    if (!s || !ctx || !aside || !hook) return kvc_fail(KVC_ERR_ARG, "aside: null argument");
    return kvc_scope_aside(s, ctx, aside, hook, user);
}
