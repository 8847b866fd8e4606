/* The scorer interface: one row per scorer (csrc/press/scorers/<name>.c), the facts the presses ask of a
 * scorer as trait bits, and the lookups. A row registers itself with KVC_REGISTER_SCORER: a pointer to it
 * lands in the linker section "kvc_scorers", which scorer.c walks between the GNU linker's
 * __start_kvc_scorers and __stop_kvc_scorers; so adding a scorer is adding one file, no list to edit. */
#ifndef KVC_SCORER_H
#define KVC_SCORER_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

typedef struct kvc_layer_rows kvc_layer_rows; /* press.h */
typedef struct kvc_layer_ctx kvc_layer_ctx;   /* core/press_i.h */

/* What a press may ask of a scorer. */
enum {
    KVC_SCORER_WINDOW = 1u << 0,      /* protects an observation window of cfg->window rows at the end */
    KVC_SCORER_HOST = 1u << 1,        /* scored on the host by its row's host function (any device) */
    KVC_SCORER_CHUNKABLE = 1u << 2,   /* ChunkPress can score a chunk alone (its rows, or its window queries) */
    KVC_SCORER_BLOCKABLE = 1u << 3,   /* reads no queries, scored by the backend: BlockPress scores a block by it */
    KVC_SCORER_READS_V = 1u << 4,     /* reads the values (introspection) */
    KVC_SCORER_READS_ATTN = 1u << 5,  /* needs the window queries' attention outputs (EDIE) */
    KVC_SCORER_OWN_BUDGET = 1u << 6,  /* acts with neither compression_ratio nor budget (SimLayerKV) */
    KVC_SCORER_FIRST_ONLY = 1u << 7,  /* reads every query's attention row of the uncompressed layer
                                       * (ObservedAttention): first in a chain, never once its call ran */
    KVC_SCORER_SAME_LEN = 1u << 8,    /* needs every KV head of a layer to hold the same rows (TOVA) */
    KVC_SCORER_LAST_QUERY = 1u << 9,  /* scores from the last query alone: window 1, no pooling (TOVA) */
    KVC_SCORER_QUERY_STATS = 1u << 10, /* scores from the call's query statistics, which given ones may replace
                                        * (ExpectedAttentionStatsPress); a decoding press buffers every row */
    KVC_SCORER_SINK_ROWS = 1u << 11,  /* needs more rows than n_sink in every head (StreamingLLM) */
    KVC_SCORER_KEEP_WINDOW = 1u << 12, /* a head keeps at least its window, whatever the ratio (DropKV, kvpress's) */
};

/* A layer's scores on the host: scores[h][0 .. len[h]) for every KV head h. */
typedef kvc_status (*kvc_host_scorer)(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                      const int64_t *len, float *const *scores);
/* A scorer's own selection from its scores (SimLayerKV): keep[h] sorted, n_keep[h] their count. */
typedef kvc_status (*kvc_scorer_select_fn)(const kvc_config *mc, const kvc_press_config *cfg, const int64_t *len,
                                           const float *const *scores, int64_t *const *keep, int64_t *n_keep);

typedef struct kvc_scorer_i {
    const char *name;          /* the Python presses' `scorer` string ("snapkv", "knorm", ...) */
    const char *title;         /* how messages name it ("SnapKV", "TOVA", ...) */
    int32_t code;              /* a built-in scorer's kvc_scorer code (core/backend.h); -1: the table gives the index */
    uint32_t traits;           /* KVC_SCORER_* bits */
    const char *const *params; /* the kvc_press_config fields it reads, NULL-terminated (introspection) */
    kvc_status (*check)(const kvc_press_config *c); /* its own settings' validation, or NULL */
    kvc_host_scorer host;      /* with KVC_SCORER_HOST; NULL: the backend's score op */
    kvc_scorer_select_fn select; /* its own selection, or NULL: the press's allocation */
    const char *doc;           /* one line: what it scores, and its paper */
} kvc_scorer_i;

/* Places a pointer to the row in the "kvc_scorers" section (one per translation unit). */
#define KVC_REGISTER_SCORER(row) \
    static const kvc_scorer_i *const kvc_scorer_entry_##row __attribute__((used, section("kvc_scorers"))) = &row

/* The row at an index (a config's `scorer`), NULL if none; and the index of a row. */
const kvc_scorer_i *kvc_scorer_of(int32_t code);
int32_t kvc_scorer_index(const kvc_scorer_i *s);
/* The row of a name, NULL if none. */
const kvc_scorer_i *kvc_scorer_find(const char *name);
/* The rows in index order: i in [0, kvc_scorer_count()) (kvc_scorer_count is public, kvpress_c.h). */
const kvc_scorer_i *kvc_scorer_at(int32_t i);

static inline int kvc_scorer_has(int32_t code, uint32_t trait) {
    const kvc_scorer_i *sc = kvc_scorer_of(code);
    return sc && (sc->traits & trait) != 0;
}
/* The titles of the scorers with any of the traits, in code order, as "A, B or C", into buf (size bytes):
 * for messages that list what a press may wrap. Returns buf. */
const char *kvc_scorer_titles(uint32_t traits, char *buf, size_t size);
/* How messages name a scorer. */
static inline const char *kvc_scorer_title(int32_t code) {
    const kvc_scorer_i *sc = kvc_scorer_of(code);
    return sc ? sc->title : "unknown scorer";
}

#endif
