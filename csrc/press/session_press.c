/* The attached press of a session (kvc_session_set_press): its slot's vtable, the chain (ComposedPress) and its
 * diagnostics. What a wrapper or a method adds to it is a part (part.h), in the method's own file. */
#include <stdio.h>

#include "press.h"

static void press_free_self(void *self) { kvc_press_free(self); }

/* The session was reset: every press of the chain back to before its first call (ChunkKV's group, the parts). */
static void press_reset_self(void *self) {
    for (kvc_press *p = self; p; p = p->next) {
        p->reuse_len = 0;
        kvc_press_parts_reset(p);
    }
}

/* The parts' state, press after press of the chain: state.press.p<i>.<part>.* */
static kvc_status press_save_state(const void *self, kvc_state_io *io) {
    int32_t i = 0;
    for (const kvc_press *p = self; p; p = p->next, i++)
        KVC_FOR_PARTS(p, row, state) {
            if (!row->save_state) continue;
            char scope[64];
            snprintf(scope, sizeof scope, "p%d.%s", i, row->name);
            const size_t mark = kvc_state_scope(io, scope);
            const kvc_status st = row->save_state(state, p, io);
            kvc_state_unscope(io, mark);
            KVC_TRY(st);
        }
    return KVC_OK;
}

static kvc_status press_load_state(void *self, kvc_session *s, kvc_state_io *io) {
    int32_t i = 0;
    for (kvc_press *p = self; p; p = p->next, i++)
        KVC_FOR_PARTS(p, row, state) {
            if (!row->load_state) continue;
            char scope[64];
            snprintf(scope, sizeof scope, "p%d.%s", i, row->name);
            const size_t mark = kvc_state_scope(io, scope);
            const kvc_status st = kvc_state_present(io) ? row->load_state(state, p, s, io) : KVC_OK;
            kvc_state_unscope(io, mark);
            KVC_TRY(st);
        }
    return KVC_OK;
}

const kvc_press_vt kvc_press_slot_vt = {.name = "press", .on_layer = kvc_press_hook, .reset = press_reset_self,
                                        .free = press_free_self, .save_state = press_save_state,
                                        .load_state = press_load_state};

kvc_status kvc_attached_press(const kvc_session *s, kvc_press **out) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    kvc_press *p = kvc_door_slot(s, &kvc_press_slot_vt);
    if (!p) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first)");
    *out = p;
    return KVC_OK;
}

kvc_status kvc_last_press(const kvc_session *s, kvc_press **out) {
    kvc_press *p = NULL;
    KVC_TRY(kvc_attached_press(s, &p));
    while (p->next) p = p->next;
    *out = p;
    return KVC_OK;
}

kvc_status kvc_session_set_press(kvc_session *s, const kvc_press_config *cfg) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    kvc_press *p = NULL;
    if (cfg) KVC_TRY(kvc_press_new(cfg, &kvc_door_model(s)->cfg, kvc_door_backend(s), &p));
    return kvc_session_attach(s, KVC_SLOT_PREFILL, p ? &kvc_press_slot_vt : NULL, p); /* the slot owns it, freed if refused */
}

kvc_status kvc_session_add_press(kvc_session *s, const kvc_press_config *cfg) {
    if (!s || !cfg) return kvc_fail(KVC_ERR_ARG, "null argument");
    kvc_press *last = kvc_door_slot(s, &kvc_press_slot_vt);
    if (!last) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first): add_press chains after it");
    if (kvc_scorer_has(cfg->scorer, KVC_SCORER_FIRST_ONLY))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "%s cannot follow another press: it reads the attention rows of "
                        "the uncompressed layer (put it first)", kvc_scorer_title(cfg->scorer));
    KVC_TRY(kvc_press_parts_chainable(last));
    kvc_press *p = NULL;
    KVC_TRY(kvc_press_new(cfg, &kvc_door_model(s)->cfg, kvc_door_backend(s), &p));
    for (kvc_press *q = last; q; q = q->next) q->chained = 1;
    while (last->next) last = last->next;
    last->next = p;
    p->chained = 1;
    return KVC_OK;
}

kvc_status kvc_session_press_scores(const kvc_session *s, int32_t layer, int32_t h, float *out, int64_t *n) {
    kvc_press *p = NULL;
    if (!n) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_attached_press(s, &p));
    return kvc_press_recorded_scores(p, layer, h, out, n);
}

kvc_status kvc_session_press_error(const kvc_session *s, int32_t layer, double *out) {
    kvc_press *p = NULL;
    if (!out) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_attached_press(s, &p));
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *out = p->error[layer];
    return KVC_OK;
}

kvc_status kvc_session_set_layer_budgets(kvc_session *s, const int64_t *totals, int32_t n_layers) {
    kvc_press *p = NULL;
    if (!totals) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_attached_press(s, &p));
    return kvc_press_set_layer_totals(p, totals, n_layers);
}

kvc_status kvc_session_press_layer_stats(const kvc_session *s, int32_t layer, double *e_internal, double *dissimilarity) {
    kvc_press *p = NULL;
    if (!e_internal || !dissimilarity) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_attached_press(s, &p));
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *e_internal = p->e_internal[layer];
    *dissimilarity = p->dissim[layer];
    return KVC_OK;
}
