/* The part table (part.h): the rows the press files registered in the linker section "kvc_parts", ranked once
 * (order, then name); a press's part states; the one rule of which parts may meet; arrays by name; the public
 * introspection and the session's setter (kvc_session_set_press_array). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

extern const kvc_press_part_i *const __start_kvc_parts[] __attribute__((visibility("hidden")));
extern const kvc_press_part_i *const __stop_kvc_parts[] __attribute__((visibility("hidden")));

int32_t kvc_part_count(void) { return (int32_t)(__stop_kvc_parts - __start_kvc_parts); }

static int before(const kvc_press_part_i *a, const kvc_press_part_i *b) {
    return a->order != b->order ? a->order < b->order : strcmp(a->name, b->name) < 0;
}

static const kvc_press_part_i *ranked[KVC_MAX_PARTS];
static pthread_once_t ranked_once = PTHREAD_ONCE_INIT;

static void rank_rows(void) {
    for (const kvc_press_part_i *const *r = __start_kvc_parts; r < __stop_kvc_parts; r++) {
        int32_t rank = 0;
        for (const kvc_press_part_i *const *o = __start_kvc_parts; o < __stop_kvc_parts; o++) rank += before(*o, *r);
        if (rank < KVC_MAX_PARTS) ranked[rank] = *r;
    }
}

const kvc_press_part_i *kvc_part_at(int32_t i) {
    if (i < 0 || i >= kvc_part_count() || i >= KVC_MAX_PARTS) return NULL;
    pthread_once(&ranked_once, rank_rows);
    return ranked[i];
}

int32_t kvc_part_index(const kvc_press_part_i *row) {
    for (int32_t i = 0; row && i < kvc_part_count(); i++)
        if (kvc_part_at(i) == row) return i;
    return -1;
}

void *kvc_press_part(const kvc_press *p, const kvc_press_part_i *row) {
    const int32_t i = kvc_part_index(row);
    return p && i >= 0 ? p->parts[i] : NULL;
}

int kvc_press_parts_have(const kvc_press *p, uint32_t traits) {
    KVC_FOR_PARTS(p, row, state)
        if ((row->traits & traits) == traits) return 1;
    return 0;
}

/* Whether a config is a plain press: what every KVC_PART_PLAIN part needs. */
static int plain(const kvc_press_config *c) {
    return c->allocation == KVC_ALLOC_UNIFORM && c->chunk_length <= 0 && c->reuse_layers <= 1 && !c->critical &&
           c->chunk_press <= 0 && c->finch_chunk <= 0;
}

/* The one rule of which parts meet on a press: one part chooses the rows; a plain part needs a plain press. */
static kvc_status kvc_part_admit(const kvc_press *p, const kvc_press_part_i *row) {
    if (row->traits & KVC_PART_SELECTS)
        KVC_FOR_PARTS(p, other, state)
            if (other != row && (other->traits & KVC_PART_SELECTS))
                return kvc_fail(KVC_ERR_ARG, "%s and %s each choose the rows a layer keeps: use one of them", other->title,
                                row->title);
    if ((row->traits & KVC_PART_PLAIN) && !plain(&p->cfg))
        return kvc_fail(KVC_ERR_ARG, "%s chooses the rows itself: wrap a plain scorer press (uniform allocation, no "
                        "chunks, no layer reuse, no ChunkPress, FINCH chunks or CriticalKV)", row->title);
    if ((row->traits & KVC_PART_ALONE) && p->chained)
        return kvc_fail(KVC_ERR_ARG, "%s acts alone: it cannot be part of a chain (ComposedPress)", row->title);
    return row->admit ? row->admit(p) : KVC_OK;
}

kvc_status kvc_press_part_state(kvc_press *p, const kvc_press_part_i *row, void **out) {
    const int32_t i = kvc_part_index(row);
    if (i < 0) return kvc_fail(KVC_ERR_INTERNAL, "press part %s is not in the table", row ? row->name : "(null)");
    if (!p->parts[i]) {
        KVC_TRY(kvc_part_admit(p, row));
        void *state = calloc(1, row->state_size ? row->state_size : 1);
        if (!state) return kvc_fail(KVC_ERR_NOMEM, "out of memory: %s", row->title);
        if (row->init) row->init(state, p);
        p->parts[i] = state;
    }
    *out = p->parts[i];
    return KVC_OK;
}

void kvc_press_parts_free(kvc_press *p) {
    for (int32_t i = 0; i < kvc_part_count(); i++) {
        if (!p->parts[i]) continue;
        const kvc_press_part_i *row = kvc_part_at(i);
        if (row->release) row->release(p->parts[i]);
        free(p->parts[i]);
        p->parts[i] = NULL;
    }
}

void kvc_press_parts_reset(kvc_press *p) {
    KVC_FOR_PARTS(p, row, state)
        if (row->reset) row->reset(state);
}

kvc_status kvc_press_parts_wanted(kvc_press *p) {
    void *state = NULL;
    for (int32_t i = 0; i < kvc_part_count(); i++) {
        const kvc_press_part_i *row = kvc_part_at(i);
        if (row->wanted && row->wanted(&p->cfg)) KVC_TRY(kvc_press_part_state(p, row, &state));
    }
    return KVC_OK;
}

kvc_status kvc_press_parts_chainable(const kvc_press *first) {
    for (const kvc_press *p = first; p; p = p->next)
        KVC_FOR_PARTS(p, row, state)
            if (row->traits & KVC_PART_ALONE)
                return kvc_fail(KVC_ERR_ARG, "%s acts alone: no press can be chained after it", row->title);
    return KVC_OK;
}

/* The array row of a name and its part, or NULL. */
static const kvc_part_array_i *find_array(const char *name, const kvc_press_part_i **part) {
    for (int32_t i = 0; name && i < kvc_part_count(); i++) {
        const kvc_press_part_i *row = kvc_part_at(i);
        for (const kvc_part_array_i *a = row->arrays; a && a->name; a++)
            if (strcmp(a->name, name) == 0) {
                *part = row;
                return a;
            }
    }
    return NULL;
}

static const char *const type_names[] = {"float32", "float64", "int64"};

/* The values an array of `count` holds on a press's model. */
static int64_t count_of(const kvc_press *p, int32_t count) {
    const int64_t L = p->n_layers, Hkv = p->n_kv, H = p->n_heads, d = p->head_dim;
    switch (count) {
    case KVC_COUNT_ONE: return 1;
    case KVC_COUNT_LAYERS: return L;
    case KVC_COUNT_KV_HEADS: return L * Hkv;
    case KVC_COUNT_KV_CHANNELS: return L * Hkv * d;
    case KVC_COUNT_Q_CHANNELS: return L * H * d;
    case KVC_COUNT_Q_CHANNELS2: return L * H * d * d;
    default: return -1;
    }
}

static const char *count_shape(const kvc_press *p, int32_t count, char *buf, size_t size) {
    switch (count) {
    case KVC_COUNT_ONE: snprintf(buf, size, "one value"); break;
    case KVC_COUNT_LAYERS: snprintf(buf, size, "[%d layers]", p->n_layers); break;
    case KVC_COUNT_KV_HEADS: snprintf(buf, size, "[%d layers, %d KV heads]", p->n_layers, p->n_kv); break;
    case KVC_COUNT_KV_CHANNELS: snprintf(buf, size, "[%d layers, %d KV heads, %d]", p->n_layers, p->n_kv, p->head_dim); break;
    case KVC_COUNT_Q_CHANNELS: snprintf(buf, size, "[%d layers, %d heads, %d]", p->n_layers, p->n_heads, p->head_dim); break;
    default:
        snprintf(buf, size, "[%d layers, %d heads, %d, %d]", p->n_layers, p->n_heads, p->head_dim, p->head_dim);
        break;
    }
    return buf;
}

kvc_status kvc_press_set_array(kvc_press *p, const char *name, int32_t type, const void *data, int64_t n) {
    const kvc_press_part_i *part = NULL;
    const kvc_part_array_i *a = find_array(name, &part);
    if (!a) return kvc_fail(KVC_ERR_ARG, "no press array named '%s' (kvc_press_array_info lists them)", name ? name : "(null)");
    if (!data) return kvc_fail(KVC_ERR_ARG, "%s: null data", name);
    if (type != a->type)
        return kvc_fail(KVC_ERR_ARG, "%s holds %s values, got %s", name, type_names[a->type],
                        type >= 0 && type <= KVC_ARRAY_I64 ? type_names[type] : "an unknown type");
    char shape[96];
    if (n != count_of(p, a->count))
        return kvc_fail(KVC_ERR_ARG, "%s (%s) needs %s, got %lld values", name, part->title,
                        count_shape(p, a->count, shape, sizeof shape), (long long)n);
    void *state = NULL;
    KVC_TRY(kvc_press_part_state(p, part, &state));
    return a->set(state, p, data, n);
}

/* ---- the public interface (kvpress_c.h) ---- */

kvc_status kvc_session_set_press_array(kvc_session *s, const char *name, int32_t type, const void *data, int64_t n) {
    kvc_press *p = NULL;
    KVC_TRY(kvc_last_press(s, &p));
    return kvc_press_set_array(p, name, type, data, n);
}

int32_t kvc_press_array_count(void) {
    int32_t n = 0;
    for (int32_t i = 0; i < kvc_part_count(); i++)
        for (const kvc_part_array_i *a = kvc_part_at(i)->arrays; a && a->name; a++) n++;
    return n;
}

static const char *const count_names[] = {"one", "layers", "layers x kv_heads", "layers x kv_heads x head_dim",
                                          "layers x heads x head_dim", "layers x heads x head_dim x head_dim"};

kvc_status kvc_press_array_info(int32_t i, kvc_press_array_desc *out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "null argument");
    int32_t k = 0;
    for (int32_t j = 0; j < kvc_part_count(); j++) {
        const kvc_press_part_i *row = kvc_part_at(j);
        for (const kvc_part_array_i *a = row->arrays; a && a->name; a++, k++)
            if (k == i) {
                out->name = a->name;
                out->press = row->title;
                out->type = a->type;
                out->shape = count_names[a->count];
                out->doc = a->doc;
                return KVC_OK;
            }
    }
    return kvc_fail(KVC_ERR_ARG, "kvc_press_array_info: no array %d (there are %d)", i, kvc_press_array_count());
}
