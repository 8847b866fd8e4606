/* Press settings by name: one table of every setting a press config holds (its name, type, place,
 * documented range), the setters and getters every binding goes through (the Python module, the ctypes
 * tests, a C client), and the introspection that lists them. The table replaces positional argument
 * lists: a binding walks it instead of repeating the fields. The range is documentation; the rule is
 * kvc_press_config_check (config.c), which every attach and compute runs. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "press.h"
#include "scorer.h"

typedef enum { T_I32, T_I64, T_U64, T_F32, T_F64, T_BOOL, T_CHOICE } ptype;

typedef struct {
    const char *name;
    ptype type;
    size_t offset;
    const char *const *choices; /* T_CHOICE: names, index = the stored code */
    double lo, hi;
    const char *doc;
} param_row;

static const char *const allocations[] = {"uniform", "pyramid", "adakv", "layer", NULL};
static const char *const safeguards[] = {"floor", "protect", NULL};

#define F(field) offsetof(kvc_press_config, field)
#define INF HUGE_VAL
static const param_row rows[] = {
    {"scorer", T_CHOICE, F(scorer), NULL, 0, 0, "what ranks the rows (kvc_scorer_names)"},
    {"allocation", T_CHOICE, F(allocation), allocations, 0, 0,
     "how many rows each head keeps: uniform, pyramid (PyramidKV), adakv (Ada-KV), layer (given layer totals, TADA)"},
    {"compression_ratio", T_F64, F(compression_ratio), NULL, 0, 1, "fraction of the rows removed (kvpress), in [0, 1)"},
    {"budget", T_I64, F(budget), NULL, 0, INF, "rows kept per KV head per layer, window inside (0: use compression_ratio)"},
    {"window", T_I32, F(window), NULL, 0, INF, "observation window: the last queries that score (window scorers)"},
    {"kernel", T_I32, F(kernel), NULL, 1, INF, "pooling kernel over the scores (odd; 1: none)"},
    {"pool_max", T_BOOL, F(pool_max), NULL, 0, 1, "max pooling instead of average"},
    {"gqa_max", T_BOOL, F(gqa_max), NULL, 0, 1, "max over a KV head's query heads instead of the mean"},
    {"pool_then_reduce", T_BOOL, F(pool_then_reduce), NULL, 0, 1, "pool per query head, then reduce (kvpress)"},
    {"n_sink", T_I32, F(n_sink), NULL, 0, INF, "first rows always kept (StreamingLLM, LagKV, ExpectedAttention)"},
    {"seed", T_U64, F(seed), NULL, 0, 18446744073709551615.0, "seed of a random scorer or sketch"},
    {"alpha_safeguard", T_F32, F(alpha_safeguard), NULL, 0, 1, "Ada-KV: share of each head's budget it keeps for sure"},
    {"safeguard", T_CHOICE, F(safeguard), safeguards, 0, 0, "Ada-KV safeguard: floor (the paper's code) or protect (kvpress)"},
    {"pyramid_beta", T_I32, F(pyramid_beta), NULL, 1, INF, "PyramidKV beta"},
    {"record_scores", T_BOOL, F(record_scores), NULL, 0, 1, "keep each layer's scores for diagnostics"},
    {"chunk_length", T_I32, F(chunk_length), NULL, 0, INF, "ChunkKV: select chunks of this many rows (0: rows)"},
    {"reuse_layers", T_I32, F(reuse_layers), NULL, 0, INF, "ChunkKV: layers that share one selection"},
    {"edie_alpha", T_F32, F(edie_alpha), NULL, 0, 100, "EDIE's alpha, in (0, 100)"},
    {"drop_window", T_BOOL, F(drop_window), NULL, 0, 1, "the window rows only score and are evicted (Judge Q, oracle)"},
    {"lag_size", T_I32, F(lag_size), NULL, 1, INF, "LagKV partition length"},
    {"cross_scoring", T_BOOL, F(cross_scoring), NULL, 0, 1, "LagKV: raw partition scores, comparable across partitions"},
    {"n_future", T_I32, F(n_future), NULL, 1, INF, "ExpectedAttention / CapPress: future positions averaged"},
    {"use_covariance", T_BOOL, F(use_covariance), NULL, 0, 1, "ExpectedAttention: add the covariance term"},
    {"use_vnorm", T_BOOL, F(use_vnorm), NULL, 0, 1, "ExpectedAttention: weigh by ||v||"},
    {"epsilon", T_F32, F(epsilon), NULL, 0, INF, "ExpectedAttention / CapPress epsilon"},
    {"critical", T_BOOL, F(critical), NULL, 0, 1, "CriticalKV two-stage selection over the scorer"},
    {"critical_eps", T_F32, F(critical_eps), NULL, 0, INF, "CriticalKV epsilon"},
    {"first_stage_ratio", T_F32, F(first_stage_ratio), NULL, 0, 1, "CriticalKV: share chosen on the plain scores"},
    {"attn_chunk", T_I32, F(attn_chunk), NULL, 1, INF, "NonCausalAttn chunk_size"},
    {"sketch_dim", T_I32, F(sketch_dim), NULL, 1, INF, "LeverageScore sketch dimension"},
    {"cur_type", T_I32, F(cur_type), NULL, 0, 3, "CUR leverage type: 0 key, 1 value, 2 kv_avg, 3 kv_product"},
    {"cur_random", T_BOOL, F(cur_random), NULL, 0, 1, "CUR: random leverage (a sketch)"},
    {"cur_window", T_I32, F(cur_window), NULL, 0, INF, "CUR local window (0: off)"},
    {"cmp_sink_start", T_I32, F(cmp_sink_start), NULL, 0, INF, "Compactor: first rows kept"},
    {"cmp_sink_end", T_I32, F(cmp_sink_end), NULL, 0, INF, "Compactor: last rows kept"},
    {"cmp_blend", T_F32, F(cmp_blend), NULL, -INF, INF, "Compactor blending of leverage and non-causal attention"},
    {"chunk_press", T_I32, F(chunk_press), NULL, 0, INF, "ChunkPress chunk_length: each chunk scored alone (0: off)"},
    {"finch_normalize", T_BOOL, F(finch_normalize), NULL, 0, 1, "FinchPress normalize_scores"},
    {"finch_chunk", T_I32, F(finch_chunk), NULL, 0, INF, "FinchPress chunk_length (0: off)"},
    {"lazy_threshold", T_F32, F(lazy_threshold), NULL, 0, 1, "SimLayerKV lazy-layer threshold"},
    {"n_recent", T_I32, F(n_recent), NULL, 1, INF, "SimLayerKV: recent rows a lazy layer keeps"},
    {"low_entropy_chunk", T_I32, F(low_entropy_chunk), NULL, 0, INF, "EntropyGatedChunkKV low-entropy chunk length"},
    {"merge", T_BOOL, F(merge), NULL, 0, 1, "MergingPress: evicted values folded into kept rows"},
    {"merge_threshold", T_F32, F(merge_threshold), NULL, 0, 1, "MergingPress similarity_threshold"},
    {"merge_fraction", T_F32, F(merge_fraction), NULL, 0, 1, "MergingPress merge_fraction, in (0, 1]"},
    {"cap_tau", T_F32, F(cap_tau), NULL, -INF, INF, "CapPress tau"},
    {"dms", T_BOOL, F(dms), NULL, 0, 1, "DMSPress: threshold eviction behind a sliding window"},
    {"dms_threshold", T_F32, F(dms_threshold), NULL, -INF, INF, "DMSPress threshold"},
    {"dms_window", T_I32, F(dms_window), NULL, 0, INF, "DMSPress sliding_window_size"},
    {"callback", T_U64, F(callback), NULL, 0, 18446744073709551615.0, "a callback scorer's kvc_scorer_callback (address)"},
    {"callback_user", T_U64, F(callback_user), NULL, 0, 18446744073709551615.0, "a callback scorer's user pointer"},
    {"callback_needs", T_I32, F(callback_needs), NULL, 0, 63, "KVC_VIEW_* bits: what a callback scorer's view carries"},
};
#undef F
#define N_ROWS ((int32_t)(sizeof rows / sizeof *rows))

/* A decoding press's own settings (kvc_decoding_config); the rest are its base press's (rows above). */
#define F(field) offsetof(kvc_decoding_config, field)
static const param_row decoding_rows[] = {
    {"compression_interval", T_I64, F(compression_interval), NULL, 1, INF, "decoding steps between compressions"},
    {"target_size", T_I64, F(target_size), NULL, 1, INF, "rows kept per KV head by a compression"},
    {"ratio_target", T_BOOL, F(ratio_target), NULL, 0, 1, "CompressionRatioDecodingPress: the target from a ratio"},
    {"target_compression_ratio", T_F64, F(target_compression_ratio), NULL, 0, 1, "its ratio of the tokens seen"},
    {"hidden_states_buffer_size", T_I32, F(hidden_states_buffer_size), NULL, 0, INF, "steps whose queries stay buffered"},
    {"cam_merge_budget", T_I32, F(cam_merge_budget), NULL, 0, INF, "CAMPress merge_budget (0: DecodingPress)"},
    {"cam_seed", T_U64, F(cam_seed), NULL, 0, 18446744073709551615.0, "CAMPress: the stream of its merge draws"},
};
#undef F
#define N_DECODING_ROWS ((int32_t)(sizeof decoding_rows / sizeof *decoding_rows))

/* ---- the scorers' names (index = the config's scorer), from the scorer table ---- */
static const char *const *scorer_names(void) {
    static const char *names[KVC_MAX_SCORERS + 1]; /* refilled each call with the same values: no state to race on */
    const int32_t n = kvc_scorer_count() < KVC_MAX_SCORERS ? kvc_scorer_count() : KVC_MAX_SCORERS;
    for (int32_t i = 0; i < n; i++) names[i] = kvc_scorer_at(i)->name;
    names[n] = NULL;
    return names;
}

static const char *const *choices_of(const param_row *r) { return r->choices ? r->choices : scorer_names(); }

static int32_t choice_code(const char *const *names, const char *name) {
    for (int32_t i = 0; names[i]; i++)
        if (!strcmp(names[i], name)) return i;
    return -1;
}


static const param_row *find_in(const param_row *t, int32_t n, const char *name) {
    if (name)
        for (int32_t i = 0; i < n; i++)
            if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}
static const param_row *find(const char *name) { return find_in(rows, N_ROWS, name); }

int32_t kvc_press_param_index(const char *name) {
    const param_row *r = find(name);
    return r ? (int32_t)(r - rows) : -1;
}

static kvc_status unknown(const char *name) {
    return kvc_fail(KVC_ERR_ARG, "unknown press setting '%s' (kvc_press_param_info lists them)", name ? name : "(null)");
}

/* ---- setters and getters on a config ---- */

static kvc_status set_i64(const param_row *r, void *obj, int64_t v) {
    const char *name = r->name;
    char *at = (char *)obj + r->offset;
    switch (r->type) {
    case T_I32:
    case T_CHOICE:
        if (v < INT32_MIN || v > INT32_MAX) return kvc_fail(KVC_ERR_ARG, "%s: %lld is out of range", name, (long long)v);
        if (r->type == T_CHOICE) {
            const char *const *names = choices_of(r);
            int32_t n = 0;
            while (names[n]) n++;
            if (v < 0 || v >= n) return kvc_fail(KVC_ERR_ARG, "unknown %s %lld", name, (long long)v);
        }
        *(int32_t *)at = (int32_t)v;
        return KVC_OK;
    case T_BOOL: *(int32_t *)at = v != 0; return KVC_OK;
    case T_I64: *(int64_t *)at = v; return KVC_OK;
    case T_U64:
        if (v < 0) return kvc_fail(KVC_ERR_ARG, "%s must be >= 0, got %lld", name, (long long)v);
        *(uint64_t *)at = (uint64_t)v;
        return KVC_OK;
    case T_F32: *(float *)at = (float)v; return KVC_OK;
    case T_F64: *(double *)at = (double)v; return KVC_OK;
    }
    return unknown(name);
}

static kvc_status set_u64(const param_row *r, void *obj, uint64_t v) {
    if (r->type == T_U64) {
        *(uint64_t *)((char *)obj + r->offset) = v;
        return KVC_OK;
    }
    if (v > (uint64_t)INT64_MAX) return kvc_fail(KVC_ERR_ARG, "%s: %llu is out of range", r->name, (unsigned long long)v);
    return set_i64(r, obj, (int64_t)v);
}

static kvc_status set_f64(const param_row *r, void *obj, double v) {
    const char *name = r->name;
    char *at = (char *)obj + r->offset;
    if (r->type == T_F32) {
        *(float *)at = (float)v;
        return KVC_OK;
    }
    if (r->type == T_F64) {
        *(double *)at = v;
        return KVC_OK;
    }
    if (r->type == T_BOOL) {
        *(int32_t *)at = v != 0;
        return KVC_OK;
    }
    if (!(v == floor(v)) || fabs(v) > 9.0e15)
        return kvc_fail(KVC_ERR_ARG, "%s must be an integer, got %g", name, v);
    return set_i64(r, obj, (int64_t)v);
}

static kvc_status set_str(const param_row *r, void *obj, const char *value) {
    const char *name = r->name;
    if (r->type != T_CHOICE) return kvc_fail(KVC_ERR_ARG, "%s takes a number, not a name", name);
    const char *const *names = choices_of(r);
    const int32_t code = value ? choice_code(names, value) : -1;
    if (code < 0) {
        char list[512] = "";
        for (int32_t i = 0; names[i]; i++) {
            if (i) strncat(list, ", ", sizeof list - strlen(list) - 1);
            strncat(list, names[i], sizeof list - strlen(list) - 1);
        }
        return kvc_fail(KVC_ERR_ARG, "unknown %s '%s': one of %s", name, value ? value : "(null)", list);
    }
    *(int32_t *)((char *)obj + r->offset) = code;
    return KVC_OK;
}

static kvc_status get(const param_row *r, const void *obj, double *out) {
    const char *at = (const char *)obj + r->offset;
    switch (r->type) {
    case T_I32:
    case T_CHOICE:
    case T_BOOL: *out = *(const int32_t *)at; break;
    case T_I64: *out = (double)*(const int64_t *)at; break;
    case T_U64: *out = (double)*(const uint64_t *)at; break;
    case T_F32: *out = *(const float *)at; break;
    case T_F64: *out = *(const double *)at; break;
    }
    return KVC_OK;
}

/* On a press config: the row by name, or the error naming it. */
#define ON_CONFIG(c, name, call)                                                                                   \
    do {                                                                                                           \
        const param_row *r_ = find(name);                                                                          \
        if (!(c)) return kvc_fail(KVC_ERR_ARG, "press config is NULL");                                           \
        if (!r_) return unknown(name);                                                                             \
        return call;                                                                                               \
    } while (0)
kvc_status kvc_press_config_set_i64(kvc_press_config *c, const char *name, int64_t v) { ON_CONFIG(c, name, set_i64(r_, c, v)); }
kvc_status kvc_press_config_set_u64(kvc_press_config *c, const char *name, uint64_t v) { ON_CONFIG(c, name, set_u64(r_, c, v)); }
kvc_status kvc_press_config_set_f64(kvc_press_config *c, const char *name, double v) { ON_CONFIG(c, name, set_f64(r_, c, v)); }
kvc_status kvc_press_config_set_str(kvc_press_config *c, const char *name, const char *v) { ON_CONFIG(c, name, set_str(r_, c, v)); }
kvc_status kvc_press_config_get(const kvc_press_config *c, const char *name, double *out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "null argument");
    ON_CONFIG(c, name, get(r_, c, out));
}

/* On a decoding config: its own rows, else its base press's. */
#define ON_DECODING(c, name, call, base_call)                                                                      \
    do {                                                                                                           \
        if (!(c)) return kvc_fail(KVC_ERR_ARG, "decoding config is NULL");                                        \
        const param_row *r_ = find_in(decoding_rows, N_DECODING_ROWS, name);                                       \
        return r_ ? call : base_call;                                                                              \
    } while (0)
kvc_status kvc_decoding_config_set_i64(kvc_decoding_config *c, const char *name, int64_t v) {
    ON_DECODING(c, name, set_i64(r_, c, v), kvc_press_config_set_i64(&c->base, name, v));
}
kvc_status kvc_decoding_config_set_u64(kvc_decoding_config *c, const char *name, uint64_t v) {
    ON_DECODING(c, name, set_u64(r_, c, v), kvc_press_config_set_u64(&c->base, name, v));
}
kvc_status kvc_decoding_config_set_f64(kvc_decoding_config *c, const char *name, double v) {
    ON_DECODING(c, name, set_f64(r_, c, v), kvc_press_config_set_f64(&c->base, name, v));
}
kvc_status kvc_decoding_config_set_str(kvc_decoding_config *c, const char *name, const char *v) {
    ON_DECODING(c, name, set_str(r_, c, v), kvc_press_config_set_str(&c->base, name, v));
}
int32_t kvc_decoding_param_known(const char *name) {
    return find_in(decoding_rows, N_DECODING_ROWS, name) || find(name);
}

/* ---- introspection ---- */

int32_t kvc_press_param_count(void) { return N_ROWS; }

kvc_status kvc_press_param_info(int32_t i, kvc_param_info *out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_press_param_info: out is NULL");
    if (i < 0 || i >= N_ROWS) return kvc_fail(KVC_ERR_ARG, "press setting %d out of range [0, %d)", i, N_ROWS);
    static const char *const type_names[] = {"int", "int", "uint", "float", "float", "bool", "choice"};
    const param_row *r = &rows[i];
    kvc_press_config d;
    kvc_press_config_defaults(&d);
    memset(out, 0, sizeof *out);
    out->name = r->name;
    out->type = type_names[r->type];
    out->doc = r->doc;
    out->lo = r->lo;
    out->hi = r->hi;
    KVC_TRY(get(r, &d, &out->default_value));
    if (r->type == T_CHOICE) {
        const char *const *names = choices_of(r);
        out->n_choices = 0;
        while (names[out->n_choices]) out->n_choices++;
        out->choices = names;
        out->default_choice = names[(int32_t)out->default_value];
    }
    return KVC_OK;
}

/* ---- a press spec: a press's settings by name, opaque to the caller ---- */

struct kvc_press_spec {
    kvc_press_config cfg;
};

kvc_status kvc_press_spec_new(const char *scorer, kvc_press_spec **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_press_spec_new: out is NULL");
    *out = NULL;
    kvc_press_spec *p = calloc(1, sizeof *p);
    if (!p) return kvc_fail(KVC_ERR_NOMEM, "out of memory: press spec");
    kvc_press_config_defaults(&p->cfg);
    kvc_status st = scorer ? kvc_press_config_set_str(&p->cfg, "scorer", scorer) : KVC_OK;
    if (st != KVC_OK) {
        free(p);
        return st;
    }
    *out = p;
    return KVC_OK;
}

void kvc_press_spec_free(kvc_press_spec *p) { free(p); }

kvc_status kvc_press_spec_set_i64(kvc_press_spec *p, const char *name, int64_t v) {
    return p ? kvc_press_config_set_i64(&p->cfg, name, v) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_set_u64(kvc_press_spec *p, const char *name, uint64_t v) {
    return p ? kvc_press_config_set_u64(&p->cfg, name, v) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_set_f64(kvc_press_spec *p, const char *name, double v) {
    return p ? kvc_press_config_set_f64(&p->cfg, name, v) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_set_str(kvc_press_spec *p, const char *name, const char *v) {
    return p ? kvc_press_config_set_str(&p->cfg, name, v) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_get(const kvc_press_spec *p, const char *name, double *out) {
    return p ? kvc_press_config_get(&p->cfg, name, out) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_check(const kvc_press_spec *p) {
    return p ? kvc_press_config_check(&p->cfg) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
kvc_status kvc_press_spec_kept(const kvc_press_spec *p, int32_t layer, int32_t n_layers, int64_t n, int64_t *out) {
    return p ? kvc_press_kept(&p->cfg, layer, n_layers, n, out) : kvc_fail(KVC_ERR_ARG, "press spec is NULL");
}
const kvc_press_config *kvc_press_spec_config(const kvc_press_spec *p) { return p ? &p->cfg : NULL; }

kvc_status kvc_session_attach_press(kvc_session *s, const kvc_press_spec *p) {
    return kvc_session_set_press(s, p ? &p->cfg : NULL);
}
kvc_status kvc_session_chain_press(kvc_session *s, const kvc_press_spec *p) {
    if (!p) return kvc_fail(KVC_ERR_ARG, "press spec is NULL");
    return kvc_session_add_press(s, &p->cfg);
}
kvc_status kvc_press_spec_compute(int32_t device, const kvc_press_spec *p, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                                  int32_t n_layers, const float *q, int64_t nq, const float *attn, int64_t n_attn,
                                  int64_t n, const float *k, const float *v, int64_t n_kv_values, int64_t len,
                                  int64_t layer_total, float *scores, int64_t n_scores, int64_t *keep, int64_t n_keep_rows,
                                  int64_t *n_keep) {
    if (!p) return kvc_fail(KVC_ERR_ARG, "press spec is NULL");
    if (H < 1 || Hkv < 1 || d < 1 || n < 0 || len < n)
        return kvc_fail(KVC_ERR_ARG, "press compute: bad shape (H %d, Hkv %d, d %d, n %lld, len %lld)", H, Hkv, d,
                        (long long)n, (long long)len);
    const int64_t qn = n * H * d, kvn = (int64_t)Hkv * len * d, sn = (int64_t)Hkv * len;
    if (!q || nq != qn) return kvc_fail(KVC_ERR_ARG, "q must hold n x H x d = %lld values, got %lld", (long long)qn, (long long)nq);
    if (attn && n_attn != qn)
        return kvc_fail(KVC_ERR_ARG, "attn must hold n x H x d = %lld values, got %lld", (long long)qn, (long long)n_attn);
    if (!k || !v || n_kv_values != kvn)
        return kvc_fail(KVC_ERR_ARG, "k and v must each hold Hkv x len x d = %lld values, got %lld", (long long)kvn,
                        (long long)n_kv_values);
    if (!scores || n_scores != sn || !keep || n_keep_rows != sn || !n_keep)
        return kvc_fail(KVC_ERR_ARG, "scores and keep must each hold Hkv x len = %lld values", (long long)sn);
    return kvc_device_press_compute(device, &p->cfg, H, Hkv, d, layer, n_layers, q, attn, n, k, v, len, layer_total, scores,
                                    keep, n_keep);
}
