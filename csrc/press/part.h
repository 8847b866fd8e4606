/* The part table: what a press adds to the per-layer schedule beyond its scorer and allocation, with state of
 * its own and arrays set by name. One row per part, in the file of its method (qfilter.c, block.c, think.c,
 * lukv.c, kvzap.c, fastkvzip.c, dms.c, ...), registered with KVC_REGISTER_PART into the linker section
 * "kvc_parts" as the scorers are (scorer.h). A press (struct kvc_press) holds one state block per part it
 * uses, made when the part's first array is set (or, for a part a setting turns on, when the press is made);
 * the schedule (schedule.c) calls the parts' hooks in the table's order and names none of them. Whether two
 * parts may meet is one rule over their trait bits (part.c: kvc_part_admit). */
#ifndef KVC_PART_H
#define KVC_PART_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

typedef struct kvc_press kvc_press;         /* press.h */
typedef struct kvc_layer_ctx kvc_layer_ctx; /* core/press_i.h */
typedef struct kvc_state_io kvc_state_io;   /* core/press_i.h */

enum {
    KVC_PART_SELECTS = 1u << 0,       /* chooses the layer's kept rows itself, in place of the allocation: one per press */
    KVC_PART_PLAIN = 1u << 1,         /* needs a plain press: uniform allocation, no chunks, no layer reuse, no
                                       * ChunkPress, FINCH chunks or CriticalKV */
    KVC_PART_NEEDS_NO_BUDGET = 1u << 2, /* evicts with neither compression_ratio nor budget (its arrays say how much) */
    KVC_PART_ALONE = 1u << 3,         /* acts on a press that is the session's only one (not a ComposedPress chain) */
    KVC_PART_WITHOUT_EVICTION = 1u << 4, /* its after_compact runs on a layer that evicted nothing too (ThinK) */
};

/* How many values an array holds, from the model: one, per layer, per (layer, KV head), per (layer, KV head,
 * channel), per (layer, query head, channel), per (layer, query head, channel, channel). */
typedef enum kvc_array_count {
    KVC_COUNT_ONE, KVC_COUNT_LAYERS, KVC_COUNT_KV_HEADS, KVC_COUNT_KV_CHANNELS, KVC_COUNT_Q_CHANNELS, KVC_COUNT_Q_CHANNELS2
} kvc_array_count;

typedef struct kvc_part_array_i {
    const char *name;  /* unique over every part ("key_filters", "block_size", ...) */
    int32_t type;      /* KVC_ARRAY_F32, KVC_ARRAY_F64 or KVC_ARRAY_I64 (kvpress_c.h) */
    int32_t count;     /* kvc_array_count */
    /* its values into the part's state, after the type and count were checked; n values */
    kvc_status (*set)(void *state, const kvc_press *p, const void *data, int64_t n);
    const char *doc;
} kvc_part_array_i;

typedef kvc_status (*kvc_part_select_fn)(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                                         const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores,
                                         int64_t *const *keep, int64_t *n_keep);

typedef struct kvc_press_part_i {
    const char *name;  /* "qfilter", "block", ... */
    const char *title; /* how messages name it ("QFilterPress", "BlockPress", ...) */
    uint32_t traits;   /* KVC_PART_* */
    int32_t order;     /* its rank among the parts: the order of their after_compact hooks */
    size_t state_size; /* the state block a press holds for it (zeroed, then init) */
    const kvc_part_array_i *arrays; /* its arrays, ended by a row whose name is NULL; or NULL */
    /* a setting of the press config that turns the part on when the press is made (DMSPress), or NULL */
    int (*wanted)(const kvc_press_config *cfg);
    /* refuses a press it cannot act on (its scorer, its budget), checked when its state is made; or NULL */
    kvc_status (*admit)(const kvc_press *p);
    void (*init)(void *state, const kvc_press *p);     /* defaults, or NULL */
    void (*release)(void *state);                      /* what the state holds (not the block itself), or NULL */
    void (*reset)(void *state);                        /* the session was reset: back to before its first call, or NULL */
    /* a layer's config seen by the rest of the schedule (PerLayerCompressionPress), or NULL */
    void (*layer_config)(const void *state, int32_t layer, kvc_press_config *cfg);
    /* the whole compression of the layer in place of the schedule's (DMSPress, FastKVzip), or NULL */
    kvc_status (*take_layer)(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx);
    kvc_part_select_fn select; /* with KVC_PART_SELECTS; else NULL */
    /* after the layer's compaction (key rerotation, ThinK's channels), or NULL */
    kvc_status (*after_compact)(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx);
    /* its state between calls into a saved cache (core/press_i.h: kvc_state_io), and read back checked against the
     * press and the cache s holds; NULL: it keeps none (its arrays are settings: the press given on load has them) */
    kvc_status (*save_state)(const void *state, const kvc_press *p, kvc_state_io *io);
    kvc_status (*load_state)(void *state, kvc_press *p, kvc_session *s, kvc_state_io *io);
    const char *doc;
} kvc_press_part_i;

#define KVC_REGISTER_PART(row) \
    static const kvc_press_part_i *const kvc_part_entry_##row __attribute__((used, section("kvc_parts"))) = &row

#define KVC_MAX_PARTS 32

int32_t kvc_part_count(void);
/* The rows in rank order (order, then name): i in [0, kvc_part_count()). */
const kvc_press_part_i *kvc_part_at(int32_t i);
int32_t kvc_part_index(const kvc_press_part_i *row);

/* The state a press holds for a part, or NULL when the part is not in use. */
void *kvc_press_part(const kvc_press *p, const kvc_press_part_i *row);
/* The state, made (zeroed, init) if the press has none yet: after the one rule of which parts meet
 * (kvc_part_admit) and the part's own admit. */
kvc_status kvc_press_part_state(kvc_press *p, const kvc_press_part_i *row, void **out);
/* Every part's state a press holds, released (kvc_press_free). */
void kvc_press_parts_free(kvc_press *p);
/* Every part's reset hook (the session was reset). */
void kvc_press_parts_reset(kvc_press *p);
/* The parts a setting of the press config turns on (kvc_press_new). */
kvc_status kvc_press_parts_wanted(kvc_press *p);
/* Whether any part a press holds has all the traits. */
int kvc_press_parts_have(const kvc_press *p, uint32_t traits);
/* Whether a press can join a chain (ComposedPress) behind `first`: no part that must act alone. */
kvc_status kvc_press_parts_chainable(const kvc_press *first);
/* An array by name set on a press: type and count checked against the row, then the part's setter. */
kvc_status kvc_press_set_array(kvc_press *p, const char *name, int32_t type, const void *data, int64_t n);

/* For each part state a press holds, in rank order: `row` the part, `state` its block. */
#define KVC_FOR_PARTS(p, row, state)                                                                   \
    for (int32_t kvc_pi_ = 0; kvc_pi_ < kvc_part_count(); kvc_pi_++)                                   \
        for (const kvc_press_part_i *row = kvc_part_at(kvc_pi_); row; row = NULL)                      \
            for (void *state = kvc_press_part(p, row); state; state = NULL)

#endif
