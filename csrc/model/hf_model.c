/* Build a kvc_model from a Hugging Face folder: config.json, then the weights from
 *   1. model.safetensors, else
 *   2. model.safetensors.index.json ("weight_map": tensor name -> shard file), else
 *   3. every *.safetensors in the folder (sorted by name; the first file holding a name wins).
 * This is the order transformers itself looks for weights in. Every shard is opened (mapped) once, each
 * tensor streamed to the backend (kvc_model_put) and its pages released, and closed before returning. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "gguf.h"
#include "model.h"
#include "safetensors.h"

#define MAX_JSON_FILE (64u << 20) /* config.json / index files are a few KB; refuse absurd sizes */

/* ---------------------------------------------------------------------------------------------- */
/* files */

static char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (!p) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: path");
        return NULL;
    }
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int is_file(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static kvc_status parse_json_file(const char *path, json_value **out) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(fp);
        return kvc_fail(KVC_ERR_IO, "'%s' is not a regular file", path);
    }
    if ((uint64_t)sb.st_size > MAX_JSON_FILE) {
        fclose(fp);
        return kvc_fail(KVC_ERR_FORMAT, "'%s' is larger than %u MiB; it cannot be a model config", path, MAX_JSON_FILE >> 20);
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fclose(fp);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory reading '%s'", path);
    }
    const size_t n = fread(buf, 1, (size_t)sb.st_size, fp);
    const int read_error = ferror(fp);
    fclose(fp);
    if (read_error) {
        free(buf);
        return kvc_fail(KVC_ERR_IO, "cannot read '%s'", path);
    }
    kvc_status st = json_parse(buf, n, path, out);
    free(buf);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* config.json */

typedef struct cfg_reader {
    const json_value *j;
    const char *path;
    const json_value *outer; /* a multimodal Gemma 3 config whose text_config j is, or NULL */
} cfg_reader;

/* A short description of a JSON value for error messages ("got -4", "got a string"). */
static const char *describe(const json_value *v, char *buf, size_t n) {
    switch (v->kind) {
    case JSON_NULL: return "null";
    case JSON_BOOL: return v->boolean ? "true" : "false";
    case JSON_NUMBER: snprintf(buf, n, "%.17g", v->number); return buf;
    case JSON_STRING: snprintf(buf, n, "\"%.40s\"", v->string); return buf;
    case JSON_ARRAY: return "a list";
    default: return "an object";
    }
}

static kvc_status bad(const cfg_reader *r, const char *key, const json_value *v, const char *want) {
    char buf[64];
    return kvc_fail(KVC_ERR_FORMAT, "%s: '%s' must be %s, got %s", r->path, key, want, describe(v, buf, sizeof buf));
}

/* Integer in [lo, hi]; `def` when absent or null, unless required. Integral floats (64.0) pass. */
static kvc_status get_int(const cfg_reader *r, const json_value *obj, const char *key, int required, int64_t def,
                          int64_t lo, int64_t hi, int32_t *out) {
    const json_value *v = json_get(obj, key);
    if (!v || v->kind == JSON_NULL) {
        if (required) return kvc_fail(KVC_ERR_FORMAT, "%s: '%s' is missing", r->path, key);
        *out = (int32_t)def;
        return KVC_OK;
    }
    if (v->kind != JSON_NUMBER || v->number != floor(v->number) || v->number < (double)lo || v->number > (double)hi) {
        char want[96];
        snprintf(want, sizeof want, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
        return bad(r, key, v, want);
    }
    *out = (int32_t)v->number;
    return KVC_OK;
}

/* Number in the open/closed interval given; `def` when absent or null, unless required. */
static kvc_status get_num(const cfg_reader *r, const json_value *obj, const char *key, int required, double def,
                          double lo, int lo_open, double hi, const char *want, double *out) {
    const json_value *v = json_get(obj, key);
    if (!v || v->kind == JSON_NULL) {
        if (required) return kvc_fail(KVC_ERR_FORMAT, "%s: '%s' is missing (%s)", r->path, key, want);
        *out = def;
        return KVC_OK;
    }
    if (v->kind != JSON_NUMBER || (lo_open ? !(v->number > lo) : !(v->number >= lo)) || !(v->number <= hi))
        return bad(r, key, v, want);
    *out = v->number;
    return KVC_OK;
}

/* true/false; `def` when absent or null. */
static kvc_status get_bool(const cfg_reader *r, const json_value *obj, const char *key, int def, int *out) {
    const json_value *v = json_get(obj, key);
    if (!v || v->kind == JSON_NULL) {
        *out = def;
        return KVC_OK;
    }
    if (v->kind != JSON_BOOL) return bad(r, key, v, "true or false");
    *out = v->boolean;
    return KVC_OK;
}

/* A token id: an integer in [0, vocab), a list of them (the first is kept; Python reads the whole
 * list for stopping), or null/absent (-1). */
static kvc_status get_token_id(const cfg_reader *r, const char *key, int32_t vocab, int32_t *out) {
    const json_value *v = json_get(r->j, key);
    *out = -1;
    if (!v || v->kind == JSON_NULL) return KVC_OK;
    char want[96];
    snprintf(want, sizeof want, "a token id in [0, %d) or a list of them", vocab);
    if (v->kind == JSON_ARRAY) {
        for (size_t i = 0; i < v->n; i++) {
            const json_value *e = &v->items[i];
            if (e->kind != JSON_NUMBER || e->number != floor(e->number) || e->number < 0 || e->number >= vocab)
                return bad(r, key, e, want);
        }
        if (v->n) *out = (int32_t)v->items[0].number;
        return KVC_OK;
    }
    if (v->kind != JSON_NUMBER || v->number != floor(v->number) || v->number < 0 || v->number >= vocab)
        return bad(r, key, v, want);
    *out = (int32_t)v->number;
    return KVC_OK;
}

/* LongRoPE's per-frequency factors (config.json lists them; the model keeps them, model.h). */
typedef struct longrope {
    float short_f[128], long_f[128]; /* [rope_dim / 2]; head_dim <= 256 */
    double linear;                   /* "linear" scaling's factor (every frequency divided by it); 0: none */
} longrope;

/* A list of n positive numbers. */
static kvc_status get_factors(const cfg_reader *r, const json_value *obj, const char *key, int32_t n, float *out) {
    const json_value *v = json_get(obj, key);
    char want[96];
    snprintf(want, sizeof want, "a list of %d positive numbers (rotary dimensions / 2)", n);
    if (!v || v->kind != JSON_ARRAY || v->n != (size_t)n) return v ? bad(r, key, v, want) : kvc_fail(KVC_ERR_FORMAT, "%s: LongRoPE needs '%s' (%s)", r->path, key, want);
    for (int32_t i = 0; i < n; i++) {
        const json_value *e = &v->items[i];
        if (e->kind != JSON_NUMBER || !(e->number > 0) || !isfinite((float)e->number)) return bad(r, key, e, want);
        out[i] = (float)e->number;
    }
    return KVC_OK;
}

/* LongRoPE as transformers computes it (_compute_longrope_parameters): inv_freq = 1 / (factor_i theta^(2i/rot))
 * with the short factors, or the long ones in a call past original_max_position_embeddings; cos and sin
 * times attention_factor, default sqrt(1 + ln s / ln original) with s = factor, else max_position_embeddings
 * / original (1 when s <= 1). */
static kvc_status read_longrope(const cfg_reader *r, const json_value *rope, kvc_config *c, longrope *lr) {
    const int32_t n = (c->rope_dim > 0 ? c->rope_dim : c->head_dim) / 2;
    KVC_TRY(get_factors(r, rope, "short_factor", n, lr->short_f));
    KVC_TRY(get_factors(r, rope, "long_factor", n, lr->long_f));
    int32_t orig = 0;
    KVC_TRY(get_int(r, r->j, "original_max_position_embeddings", 0, 0, 1, INT32_MAX, &orig));
    KVC_TRY(get_int(r, rope, "original_max_position_embeddings", orig == 0, orig, 1, INT32_MAX, &orig));
    double factor = 0, attn = 0;
    KVC_TRY(get_num(r, rope, "factor", 0, (double)c->max_context / orig, 0.0, 1, 1e6, "a number > 0", &factor));
    KVC_TRY(get_num(r, rope, "attention_factor", 0, 0.0, 0.0, 0, 1e6, "a number >= 0", &attn));
    if (!json_get(rope, "attention_factor") || json_get(rope, "attention_factor")->kind == JSON_NULL)
        attn = factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log((double)orig));
    c->rope_long_context = orig;
    c->rope_attn_factor = (float)attn;
    return KVC_OK;
}

/* RoPE settings. transformers >= 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}};
 * older files write a top-level "rope_theta" and "rope_scaling": {"rope_type" or "type", ...}.
 * As in transformers: a non-empty rope_scaling wins over rope_parameters, and rope_theta inside the
 * dict wins over the top-level one. "default", "llama3" and (Phi-3) "longrope" are implemented; a partial
 * rotary factor is read at the top level or inside the dict. */
static kvc_status read_rope(const cfg_reader *r, kvc_config *c, longrope *lr) {
    const json_value *rs = json_get(r->j, "rope_scaling"), *rp = json_get(r->j, "rope_parameters");
    if (rs && rs->kind != JSON_NULL && rs->kind != JSON_OBJECT) return bad(r, "rope_scaling", rs, "an object or null");
    if (rp && rp->kind != JSON_NULL && rp->kind != JSON_OBJECT) return bad(r, "rope_parameters", rp, "an object or null");
    const json_value *rope = (rs && rs->kind == JSON_OBJECT && rs->n > 0) ? rs : (rp && rp->kind == JSON_OBJECT ? rp : NULL);
    const char *rope_key = rope == rs ? "rope_scaling" : "rope_parameters";
    /* per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}}): we run full attention */
    const json_value *full = json_get(rope, "full_attention");
    if (full && full->kind == JSON_OBJECT && !json_get(rope, "rope_type") && !json_get(rope, "type")) rope = full;

    const double def_theta = c->arch == KVC_ARCH_GEMMA3 || c->arch == KVC_ARCH_MIXTRAL ? 1e6 : 10000.0; /* transformers' defaults */
    double theta = def_theta; /* get_num writes it; set here so the compiler sees it set */
    lr->linear = 0;
    KVC_TRY(get_num(r, r->j, "rope_theta", 0, def_theta, 1.0, 1, 1e30, "a number > 1", &theta));
    if (rope) KVC_TRY(get_num(r, rope, "rope_theta", 0, theta, 1.0, 1, 1e30, "a number > 1", &theta));
    c->rope_theta = (float)theta;
    double partial = 1.0;
    KVC_TRY(get_num(r, r->j, "partial_rotary_factor", 0, 1.0, 0.0, 1, 1.0, "a number in (0, 1]", &partial));
    if (rope) KVC_TRY(get_num(r, rope, "partial_rotary_factor", 0, partial, 0.0, 1, 1.0, "a number in (0, 1]", &partial));
    if (partial < 1.0) { /* transformers: int(head_dim * factor) dimensions turn */
        const int32_t rot = (int32_t)(c->head_dim * partial);
        if (rot < 2 || rot % 2)
            return kvc_fail(KVC_ERR_FORMAT, "%s: partial_rotary_factor %g of head_dim %d gives %d rotary dimensions (must be even, >= 2)",
                            r->path, partial, c->head_dim, rot);
        c->rope_dim = rot;
    }
    if (!rope) return KVC_OK;

    const json_value *t = json_get(rope, "rope_type");
    if (!t || t->kind == JSON_NULL) t = json_get(rope, "type");
    const char *type = "default";
    if (t && t->kind != JSON_NULL) {
        if (t->kind != JSON_STRING) return bad(r, "rope_type", t, "a string");
        type = t->string;
    } else if (json_get(rope, "factor")) {
        return kvc_fail(KVC_ERR_FORMAT, "%s: '%s' has a 'factor' but no 'rope_type'", r->path, rope_key);
    }
    if (!strcmp(type, "default")) return KVC_OK;
    /* transformers' Phi3Config reads the old names "su" and "yarn" as longrope */
    if (!strcmp(type, "longrope") || (c->arch == KVC_ARCH_PHI3 && (!strcmp(type, "su") || !strcmp(type, "yarn"))))
        return read_longrope(r, rope, c, lr);
    if (!strcmp(type, "linear")) /* transformers: inv_freq / factor (Gemma 3's global layers) */
        return get_num(r, rope, "factor", 1, 0, 0.0, 1, 1e6, "a number > 0", &lr->linear);
    if (strcmp(type, "llama3") != 0)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: rope scaling '%.40s' is not supported (only 'llama3', 'longrope', 'linear' and "
                        "'default' are)", r->path, type);
    double f, lo, hi;
    int32_t orig;
    KVC_TRY(get_num(r, rope, "factor", 1, 0, 0.0, 1, 1e6, "a number > 0", &f));
    KVC_TRY(get_num(r, rope, "low_freq_factor", 1, 0, 0.0, 1, 1e6, "a number > 0", &lo));
    KVC_TRY(get_num(r, rope, "high_freq_factor", 1, 0, 0.0, 1, 1e6, "a number > 0", &hi));
    if (!(hi > lo))
        return kvc_fail(KVC_ERR_FORMAT, "%s: llama3 rope scaling needs high_freq_factor (%g) > low_freq_factor (%g)", r->path,
                        hi, lo);
    /* transformers defaults it to max_position_embeddings */
    KVC_TRY(get_int(r, rope, "original_max_position_embeddings", 0, c->max_context, 1, INT32_MAX, &orig));
    if (orig < 1) return kvc_fail(KVC_ERR_FORMAT, "%s: llama3 rope scaling needs original_max_position_embeddings", r->path);
    c->rope_scaling_factor = (float)f;
    c->rope_low_freq_factor = (float)lo;
    c->rope_high_freq_factor = (float)hi;
    c->rope_original_context = orig;
    return KVC_OK;
}

/* Sliding-window attention, as transformers reads it. mistral and phi3: "sliding_window" on every layer (4096 when
 * the key is absent, none when null). qwen2/qwen3: only with "use_sliding_window", on the layers from
 * "max_window_layers" (default 28) on, or as "layer_types" lists them. A window the engine cannot express
 * (sliding layers before full ones) is refused rather than run as full attention. */
static kvc_status read_sliding_window(const cfg_reader *r, kvc_config *c) {
    const json_value *j = r->j;
    c->sliding_window = 0;
    c->window_first_layer = 0;
    const json_value *w = json_get(j, "sliding_window");
    int32_t window = 0; /* absent: transformers' default, 4096 */
    KVC_TRY(get_int(r, j, "sliding_window", 0, 4096, 1, INT32_MAX, &window));
    if (c->arch == KVC_ARCH_LLAMA) return KVC_OK; /* transformers' llama has no window */
    if (w && w->kind == JSON_NULL) return KVC_OK; /* null: no window */
    if (c->arch == KVC_ARCH_PHI3 || c->arch == KVC_ARCH_MIXTRAL) { /* every layer, when the key is there (default: none) */
        c->sliding_window = w ? window : 0;
        return KVC_OK;
    }
    if (c->arch == KVC_ARCH_MISTRAL) {
        c->sliding_window = window;
        return KVC_OK;
    }
    int use = 0;
    KVC_TRY(get_bool(r, j, "use_sliding_window", 0, &use));
    if (!use) return KVC_OK;
    if (c->arch == KVC_ARCH_QWEN3_MOE) { /* Qwen3MoeConfig: every layer (no max_window_layers) */
        c->sliding_window = window;
        return KVC_OK;
    }
    int32_t first = 28;
    KVC_TRY(get_int(r, j, "max_window_layers", 0, 28, 0, INT32_MAX, &first));
    const json_value *types = json_get(j, "layer_types");
    if (types && types->kind != JSON_NULL) {
        if (types->kind != JSON_ARRAY || types->n != (size_t)c->n_layers)
            return bad(r, "layer_types", types, "a list of one string per layer");
        first = c->n_layers;
        for (size_t i = 0; i < types->n; i++) {
            const json_value *t = &types->items[i];
            const int sliding = t->kind == JSON_STRING && !strcmp(t->string, "sliding_attention");
            if (!sliding && !(t->kind == JSON_STRING && !strcmp(t->string, "full_attention")))
                return bad(r, "layer_types", t, "\"full_attention\" or \"sliding_attention\"");
            if (sliding && first == c->n_layers) first = (int32_t)i;
            if (!sliding && first < c->n_layers)
                return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: layer_types puts a full-attention layer (%zu) after a sliding-window "
                                "one (%d); kvpress_c runs windows only on the last layers", r->path, i, first);
        }
    }
    if (first >= c->n_layers) return KVC_OK; /* no layer slides */
    c->sliding_window = window;
    c->window_first_layer = first;
    return KVC_OK;
}

/* Gemma's sliding layers, as transformers reads them: "layer_types", else every layer but each
 * "sliding_window_pattern"-th (default 6; Gemma 2: every other layer) slides; a pattern the engine cannot
 * express (every P-th layer full, the others sliding) is refused. Gemma 3's sliding layers turn on their own
 * RoPE base: rope_parameters.sliding_attention.rope_theta, else "rope_local_base_freq" (default 10000),
 * unscaled; Gemma 2's on the one rope_theta. */
static kvc_status read_gemma_layers(const cfg_reader *r, kvc_config *c) {
    const json_value *j = r->j;
    const int g2 = c->arch == KVC_ARCH_GEMMA2;
    int32_t window = 0, period = g2 ? 2 : 6;
    KVC_TRY(get_int(r, j, "sliding_window", 0, 4096, 1, INT32_MAX, &window));
    if (!g2) KVC_TRY(get_int(r, j, "sliding_window_pattern", 0, 6, 1, INT32_MAX, &period));
    const json_value *types = json_get(j, "layer_types");
    if (types && types->kind != JSON_NULL) {
        if (types->kind != JSON_ARRAY || types->n != (size_t)c->n_layers)
            return bad(r, "layer_types", types, "a list of one string per layer");
        period = 0; /* the first full layer's index + 1; 0: none is full */
        for (size_t i = 0; i < types->n; i++) {
            const json_value *t = &types->items[i];
            const int sliding = t->kind == JSON_STRING && !strcmp(t->string, "sliding_attention");
            if (!sliding && !(t->kind == JSON_STRING && !strcmp(t->string, "full_attention")))
                return bad(r, "layer_types", t, "\"full_attention\" or \"sliding_attention\"");
            if (!sliding && period == 0) period = (int32_t)i + 1;
        }
        for (size_t i = 0; i < types->n; i++) {
            const int full = !strcmp(types->items[i].string, "full_attention");
            if (full != (period > 0 && (int32_t)(i + 1) % period == 0))
                return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: layer_types is not 'every P-th layer full, the others sliding' "
                                "(layer %zu); kvpress_c runs Gemma's windows in that pattern only", r->path, i);
        }
    }
    c->sliding_window = window;
    c->window_first_layer = 0;
    c->window_period = period;
    if (g2) return KVC_OK;
    /* the sliding layers' RoPE */
    double local = 10000.0;
    KVC_TRY(get_num(r, j, "rope_local_base_freq", 0, 10000.0, 1.0, 1, 1e30, "a number > 1", &local));
    const json_value *rp = json_get(j, "rope_parameters"), *sl = rp ? json_get(rp, "sliding_attention") : NULL;
    if (sl && sl->kind == JSON_OBJECT) {
        KVC_TRY(get_num(r, sl, "rope_theta", 0, local, 1.0, 1, 1e30, "a number > 1", &local));
        const json_value *t = json_get(sl, "rope_type");
        if (t && t->kind != JSON_NULL && !(t->kind == JSON_STRING && !strcmp(t->string, "default")))
            return bad(r, "rope_parameters.sliding_attention.rope_type", t, "\"default\" (kvpress_c scales only the full layers' RoPE)");
    }
    c->rope_local_theta = (float)local;
    return KVC_OK;
}

/* A soft-capping value: `def` when absent, none (0) when null, else a number > 0. */
static kvc_status get_softcap(const cfg_reader *r, const char *key, double def, float *out) {
    const json_value *v = json_get(r->j, key);
    double x = def;
    if (v && v->kind == JSON_NULL) x = 0;
    else KVC_TRY(get_num(r, r->j, key, 0, def, 0.0, 1, 1e30, "a number > 0 or null", &x));
    *out = (float)x;
    return KVC_OK;
}

/* Gemma 2 and 3's own settings: norms after attention and MLP, GeGLU, the embedding and attention scales,
 * soft-capping (Gemma 2's defaults 50 and 30 when absent), Gemma 3's q/k norms; bidirectional attention is
 * refused. transformers' Gemma 3 reads attn_logit_softcapping and does not apply it (its attention call passes
 * no softcap): nor does kvpress_c there; its final_logit_softcapping it applies, as we do. */
static kvc_status read_gemma(const cfg_reader *r, kvc_config *c) {
    const json_value *j = r->j;
    const int g2 = c->arch == KVC_ARCH_GEMMA2;
    const json_value *act = json_get(j, "hidden_activation");
    if (!act || act->kind == JSON_NULL) act = json_get(j, "hidden_act");
    if (act && act->kind != JSON_NULL && !(act->kind == JSON_STRING && !strcmp(act->string, "gelu_pytorch_tanh")))
        return act->kind == JSON_STRING ? kvc_fail(KVC_ERR_UNSUPPORTED, "%s: hidden_activation '%.40s' is not supported for "
                                                   "%s (gelu_pytorch_tanh is)", r->path, act->string, g2 ? "gemma2" : "gemma3_text")
                                        : bad(r, "hidden_activation", act, "a string");
    float attn_cap = 0;
    KVC_TRY(get_softcap(r, "attn_logit_softcapping", g2 ? 50.0 : 0.0, &attn_cap));
    KVC_TRY(get_softcap(r, "final_logit_softcapping", g2 ? 30.0 : 0.0, &c->logit_softcap));
    if (g2) c->attn_softcap = attn_cap;
    int bidir = 0;
    KVC_TRY(get_bool(r, j, "use_bidirectional_attention", 0, &bidir));
    if (bidir) return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: use_bidirectional_attention = true is not supported", r->path);
    double qpas = 256;
    KVC_TRY(get_num(r, j, "query_pre_attn_scalar", 0, 256.0, 0.0, 1, 1e12, "a number > 0", &qpas));
    c->attn_scale = (float)pow(qpas, -0.5);
    c->embed_scale = (float)sqrt((double)c->hidden); /* transformers: a float32 tensor of hidden_size ** 0.5 */
    c->qk_norm = !g2;
    c->post_norms = 1;
    c->mlp_act = KVC_MLP_GELU_TANH;
    return read_gemma_layers(r, c);
}

/* Mixture of experts as transformers reads it. qwen3_moe: num_experts (num_local_experts, what transformers 5 writes
 * through its attribute map, wins), num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step
 * and mlp_only_layers (those layers' MLPs dense, of intermediate_size), with Qwen3MoeConfig's defaults 128, 8, 768,
 * false, 1 and none; 0 experts: every MLP dense. mixtral: num_local_experts (8) experts of intermediate_size,
 * num_experts_per_tok (2), the chosen weights always renormalised (a softmax over the top-k logits). */
static kvc_status read_moe(const cfg_reader *r, kvc_config *c) {
    const json_value *j = r->j;
    c->moe_step = 1;
    if (c->arch == KVC_ARCH_MIXTRAL) {
        KVC_TRY(get_int(r, j, "num_local_experts", 0, 8, 1, 4096, &c->n_experts));
        KVC_TRY(get_int(r, j, "num_experts_per_tok", 0, 2, 1, c->n_experts, &c->n_experts_used));
        c->moe_ffn = c->ffn;
        c->moe_norm_topk = 1;
        return KVC_OK;
    }
    int32_t n = 128;
    KVC_TRY(get_int(r, j, "num_experts", 0, 128, 0, 4096, &n));
    KVC_TRY(get_int(r, j, "num_local_experts", 0, n, 0, 4096, &n));
    if (n == 0) return KVC_OK;
    c->n_experts = n;
    KVC_TRY(get_int(r, j, "num_experts_per_tok", 0, 8, 1, n, &c->n_experts_used));
    KVC_TRY(get_int(r, j, "moe_intermediate_size", 0, 768, 1, 1 << 20, &c->moe_ffn));
    KVC_TRY(get_bool(r, j, "norm_topk_prob", 0, &c->moe_norm_topk));
    KVC_TRY(get_int(r, j, "decoder_sparse_step", 0, 1, 1, INT32_MAX, &c->moe_step));
    const json_value *dense = json_get(j, "mlp_only_layers");
    if (!dense || dense->kind == JSON_NULL) return KVC_OK;
    if (dense->kind != JSON_ARRAY) return bad(r, "mlp_only_layers", dense, "a list of layer indices");
    for (size_t i = 0; i < dense->n; i++) {
        const json_value *e = &dense->items[i];
        if (e->kind != JSON_NUMBER || e->number != floor(e->number)) return bad(r, "mlp_only_layers", e, "a layer index");
        if (e->number < 0 || e->number >= c->n_layers) continue; /* no layer has it: transformers never asks */
        const int32_t l = (int32_t)e->number;
        if (l >= KVC_MOE_DENSE_LAYERS)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: mlp_only_layers lists layer %d; dense layers past layer %d are not "
                            "supported", r->path, l, KVC_MOE_DENSE_LAYERS - 1);
        c->moe_dense[l / 32] |= 1u << (l % 32);
    }
    return KVC_OK;
}

/* `tied` is set to -1 when config.json does not say (decided from the weights later). */
static kvc_status read_config(const cfg_reader *r, kvc_config *c, longrope *lr) {
    kvc_config_defaults(c);
    const json_value *j = r->j;
    if (j->kind != JSON_OBJECT) return kvc_fail(KVC_ERR_FORMAT, "%s is not a JSON object", r->path);
    const json_value *mt = json_get(j, "model_type");
    if (r->outer && !mt) c->arch = KVC_ARCH_GEMMA3; /* a text_config without its model_type */
    else if (!mt || mt->kind != JSON_STRING)
        return kvc_fail(KVC_ERR_FORMAT, "%s: 'model_type' is missing or not a string", r->path);
    else if (r->outer && strcmp(mt->string, "gemma3_text") != 0)
        return kvc_fail(KVC_ERR_FORMAT, "%s: text_config's model_type is '%.40s', not gemma3_text", r->path, mt->string);
    else if (!strcmp(mt->string, "llama")) c->arch = KVC_ARCH_LLAMA;
    else if (!strcmp(mt->string, "mistral")) c->arch = KVC_ARCH_MISTRAL;
    else if (!strcmp(mt->string, "qwen2")) c->arch = KVC_ARCH_QWEN2;
    else if (!strcmp(mt->string, "qwen3")) c->arch = KVC_ARCH_QWEN3;
    else if (!strcmp(mt->string, "phi3")) c->arch = KVC_ARCH_PHI3; /* Phi-3, Phi-3.5, Phi-4-mini */
    else if (!strcmp(mt->string, "gemma3_text")) c->arch = KVC_ARCH_GEMMA3; /* Gemma3ForCausalLM */
    else if (!strcmp(mt->string, "gemma2")) c->arch = KVC_ARCH_GEMMA2;      /* Gemma2ForCausalLM */
    else if (!strcmp(mt->string, "qwen3_moe")) c->arch = KVC_ARCH_QWEN3_MOE;
    else if (!strcmp(mt->string, "mixtral")) c->arch = KVC_ARCH_MIXTRAL;
    else
        return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: model_type '%.60s' is not supported (llama, mistral, mixtral, qwen2, qwen3, "
                        "qwen3_moe, phi3, gemma2, gemma3_text and gemma3's text model are)", r->path, mt->string);
    const int gemma = c->arch == KVC_ARCH_GEMMA2 || c->arch == KVC_ARCH_GEMMA3;
    c->rope_pairing = KVC_ROPE_HALF; /* HF checkpoints rotate (i, i + d/2) pairs */
    c->qkv_bias = c->arch == KVC_ARCH_QWEN2;
    c->qk_norm = c->arch == KVC_ARCH_QWEN3 || c->arch == KVC_ARCH_QWEN3_MOE;

    /* features that would change the computation and that the engine does not have */
    const json_value *act = json_get(j, "hidden_act");
    if (act && act->kind != JSON_NULL && !gemma) { /* gemma: read_gemma */
        if (act->kind != JSON_STRING) return bad(r, "hidden_act", act, "a string");
        if (strcmp(act->string, "silu") != 0 && strcmp(act->string, "swish") != 0)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: hidden_act '%.40s' is not supported (silu is)", r->path, act->string);
    }
    int flag = 0;
    KVC_TRY(get_bool(r, j, "attention_bias", 0, &flag));
    if (flag && c->arch != KVC_ARCH_QWEN2)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: attention_bias = true (biases on q/k/v/o projections) is not supported", r->path);
    KVC_TRY(get_bool(r, j, "mlp_bias", 0, &flag));
    if (flag) return kvc_fail(KVC_ERR_UNSUPPORTED, "%s: mlp_bias = true is not supported", r->path);

    const int g3 = c->arch == KVC_ARCH_GEMMA3; /* Gemma3TextConfig's defaults (text_configs omit what equals them) */
    KVC_TRY(get_int(r, j, "num_hidden_layers", !g3, 26, 1, 4096, &c->n_layers));
    KVC_TRY(get_int(r, j, "hidden_size", !g3, 2304, 1, 65536, &c->hidden));
    KVC_TRY(get_int(r, j, "num_attention_heads", !g3, 8, 1, 1024, &c->n_heads));
    KVC_TRY(get_int(r, j, "num_key_value_heads", 0, g3 ? 4 : c->n_heads, 1, c->n_heads, &c->n_kv_heads));
    if (c->n_heads % c->n_kv_heads != 0)
        return kvc_fail(KVC_ERR_FORMAT, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)", r->path,
                        c->n_heads, c->n_kv_heads);
    /* transformers: head_dim = hidden_size // num_attention_heads unless given */
    const int32_t def_hd = gemma ? 256 : c->hidden / c->n_heads; /* Gemma2Config, Gemma3TextConfig: 256 */
    KVC_TRY(get_int(r, j, "head_dim", 0, def_hd, 1, 256, &c->head_dim));
    if (c->head_dim < 2 || c->head_dim % 2)
        return kvc_fail(KVC_ERR_FORMAT, "%s: head_dim (%d%s) must be even (RoPE rotates pairs)", r->path, c->head_dim,
                        json_get(j, "head_dim") ? "" : " = hidden_size / num_attention_heads");
    KVC_TRY(get_int(r, j, "intermediate_size", !g3, 9216, 1, 1 << 20, &c->ffn));
    KVC_TRY(get_int(r, j, "vocab_size", !g3, 262208, 1, 1 << 24, &c->vocab));
    /* informational (and llama3's default original context); transformers' per-model defaults */
    const int64_t def_ctx = c->arch == KVC_ARCH_LLAMA ? 2048 : c->arch == KVC_ARCH_PHI3 ? 4096 : c->arch == KVC_ARCH_GEMMA3 ? 131072
                          : c->arch == KVC_ARCH_GEMMA2 ? 8192
                          : c->arch == KVC_ARCH_MISTRAL || c->arch == KVC_ARCH_MIXTRAL ? 4096 * 32 : 32768;
    KVC_TRY(get_int(r, j, "max_position_embeddings", 0, def_ctx, 1, INT32_MAX, &c->max_context));
    double eps;
    KVC_TRY(get_num(r, j, "rms_norm_eps", 0, 1e-6, 0.0, 1, 0.5, "a number in (0, 0.5]", &eps));
    c->rms_eps = (float)eps;
    if (!(c->rms_eps > 0)) return bad(r, "rms_norm_eps", json_get(j, "rms_norm_eps"), "representable as a positive float32");
    KVC_TRY(read_rope(r, c, lr));

    KVC_TRY(gemma ? read_gemma(r, c) : read_sliding_window(r, c));
    if (c->arch == KVC_ARCH_QWEN3_MOE || c->arch == KVC_ARCH_MIXTRAL) KVC_TRY(read_moe(r, c));

    /* Tied output: transformers' llama/mistral/qwen2 configs default to untied. We follow an explicit
     * true/false; when the key is absent, the weights decide (no lm_head.weight -> tied) instead of
     * leaving lm_head uninitialised as transformers would. */
    const json_value *tie = json_get(j, "tie_word_embeddings");
    if (tie && tie->kind != JSON_NULL && tie->kind != JSON_BOOL) return bad(r, "tie_word_embeddings", tie, "true or false");
    c->tied_embeddings = (tie && tie->kind == JSON_BOOL) ? tie->boolean : gemma ? 1 : -1;

    KVC_TRY(get_token_id(r, "bos_token_id", c->vocab, &c->bos_id));
    KVC_TRY(get_token_id(r, "eos_token_id", c->vocab, &c->eos_id));
    if (r->outer) { /* a multimodal config: its own ids where the text_config has none */
        const cfg_reader o = {r->outer, r->path, NULL};
        if (c->bos_id < 0) KVC_TRY(get_token_id(&o, "bos_token_id", c->vocab, &c->bos_id));
        if (c->eos_id < 0) KVC_TRY(get_token_id(&o, "eos_token_id", c->vocab, &c->eos_id));
    }
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* weights */

typedef struct shard {
    char *name; /* file name inside the folder */
    st_file *file;
} shard;

typedef struct weights {
    const char *dir;
    shard *shards;
    int n, cap;
    json_value *index;            /* parsed model.safetensors.index.json, or NULL */
    const json_value *weight_map; /* inside index */
    char *index_path;
    int multimodal; /* Gemma3ForConditionalGeneration: the text model's tensors under its language model */
} weights;

static void weights_close(weights *w) {
    for (int i = 0; i < w->n; i++) {
        st_close(w->shards[i].file);
        free(w->shards[i].name);
    }
    free(w->shards);
    json_free(w->index);
    free(w->index_path);
    memset(w, 0, sizeof *w);
}

static void weights_free(void *w) {
    if (!w) return;
    weights_close(w);
    free(w);
}

static int shard_index(const weights *w, const char *name) {
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->shards[i].name, name)) return i;
    return -1;
}

static kvc_status add_shard(weights *w, const char *name) {
    if (shard_index(w, name) >= 0) return KVC_OK;
    if (!*name || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
        return kvc_fail(KVC_ERR_FORMAT, "%s: shard '%.200s' is not a plain file name in the folder",
                        w->weight_map ? w->index_path : w->dir, name);
    if (w->n == w->cap) {
        const int cap = w->cap ? w->cap * 2 : 8;
        shard *s = realloc(w->shards, (size_t)cap * sizeof *s);
        if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: shard list");
        w->shards = s;
        w->cap = cap;
    }
    char *path = join(w->dir, name);
    if (!path) return KVC_ERR_NOMEM;
    shard *s = &w->shards[w->n];
    s->file = NULL;
    s->name = strdup(name);
    kvc_status st = s->name ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: shard name");
    if (st == KVC_OK) {
        st = st_open(path, &s->file);
        if (st == KVC_ERR_IO && w->weight_map && !is_file(path))
            st = kvc_fail(KVC_ERR_IO, "%s names the shard '%s', which is not in '%s'", w->index_path, name, w->dir);
    }
    free(path);
    if (st != KVC_OK) {
        free(s->name);
        return st;
    }
    w->n++;
    return KVC_OK;
}

static int str_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every *.safetensors file in the folder, in sorted order. */
static kvc_status open_all(weights *w) {
    DIR *d = opendir(w->dir);
    if (!d) return kvc_fail(KVC_ERR_IO, "cannot list '%s': %s", w->dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    kvc_status st = KVC_OK;
    struct dirent *e;
    while (st == KVC_OK && (e = readdir(d))) {
        const size_t l = strlen(e->d_name);
        if (l <= 12 || strcmp(e->d_name + l - 12, ".safetensors") != 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            char **p = realloc(names, cap * sizeof *p);
            if (!p) {
                st = kvc_fail(KVC_ERR_NOMEM, "out of memory: file list");
                break;
            }
            names = p;
        }
        if (!(names[n] = strdup(e->d_name))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: file list");
        else n++;
    }
    closedir(d);
    if (st == KVC_OK && n > 1) qsort(names, n, sizeof *names, str_cmp); /* names is NULL when n == 0 */
    for (size_t i = 0; st == KVC_OK && i < n; i++) st = add_shard(w, names[i]);
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (st == KVC_OK && w->n == 0)
        st = kvc_fail(KVC_ERR_IO, "no safetensors weights in '%s' (model.safetensors, model.safetensors.index.json or "
                      "*.safetensors): a Hugging Face model folder needs config.json and *.safetensors", w->dir);
    return st;
}

static kvc_status open_weights(weights *w) {
    char *single = join(w->dir, "model.safetensors");
    if (!single) return KVC_ERR_NOMEM;
    const int have_single = is_file(single);
    free(single);
    if (have_single) return add_shard(w, "model.safetensors");
    if (!(w->index_path = join(w->dir, "model.safetensors.index.json"))) return KVC_ERR_NOMEM;
    if (!is_file(w->index_path)) return open_all(w);
    KVC_TRY(parse_json_file(w->index_path, &w->index));
    w->weight_map = json_get(w->index, "weight_map");
    if (!w->weight_map || w->weight_map->kind != JSON_OBJECT)
        return kvc_fail(KVC_ERR_FORMAT, "%s has no \"weight_map\" object", w->index_path);
    for (size_t i = 0; i < w->weight_map->n; i++) {
        const json_value *v = &w->weight_map->items[i];
        if (v->kind != JSON_STRING)
            return kvc_fail(KVC_ERR_FORMAT, "%s: weight_map['%.200s'] must be a file name", w->index_path, w->weight_map->keys[i]);
        KVC_TRY(add_shard(w, v->string)); /* each distinct file once */
    }
    if (w->n == 0) return kvc_fail(KVC_ERR_FORMAT, "%s: weight_map is empty", w->index_path);
    return KVC_OK;
}

/* The tensor `name`, or NULL with *st = KVC_OK when no file has it (the caller decides whether
 * that is an error). With an index, only the shard it names is consulted. */
static const st_tensor *find_exact(const weights *w, const char *name, kvc_status *st) {
    *st = KVC_OK;
    if (w->weight_map) {
        const json_value *v = json_get(w->weight_map, name);
        if (!v) return NULL;
        const int i = shard_index(w, v->string);
        const st_tensor *t = i >= 0 ? st_find(w->shards[i].file, name) : NULL;
        if (!t)
            *st = kvc_fail(KVC_ERR_FORMAT, "%s lists tensor '%s' in shard '%s', but that file does not contain it", w->index_path,
                           name, v->string);
        return t;
    }
    for (int i = 0; i < w->n; i++) {
        const st_tensor *t = st_find(w->shards[i].file, name);
        if (t) return t;
    }
    return NULL;
}

/* A text model's tensor by its Gemma3ForCausalLM name; in a multimodal Gemma 3 folder, where transformers puts
 * it: "model.X" as "model.language_model.X" (transformers >= 4.52) or "language_model.model.X" (before), and
 * "lm_head.weight" also as "language_model.lm_head.weight". */
static const st_tensor *find(const weights *w, const char *name, kvc_status *st) {
    if (!w->multimodal) return find_exact(w, name, st);
    char alt[256];
    const int model = !strncmp(name, "model.", 6);
    const char *forms[2][2] = {{"model.language_model.", "language_model.model."}, {"", "language_model."}};
    for (int i = 0; i < 2; i++) {
        snprintf(alt, sizeof alt, "%s%s", forms[!model][i], model ? name + 6 : name);
        const st_tensor *t = find_exact(w, alt, st);
        if (t || *st != KVC_OK) return t;
    }
    return NULL;
}

static void shape_str(const int64_t *shape, int n, char *buf, size_t size) {
    size_t k = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < n && k < size; i++) k += (size_t)snprintf(buf + k, size - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < size) snprintf(buf + k, size - k, "]");
}

static kvc_status decode_rows(const kvc_src *s, int64_t r0, int64_t nr, float *dst) {
    return st_range_to_f32((const st_tensor *)s->ctx, r0 * s->cols, nr * s->cols, dst);
}

/* Tensor `name` of shape [rows, cols] (or [cols] when rows == 0) as a source of rows (an expert's: its own tensor, the
 * name holds its index). */
static kvc_status tensor_source(const void *file, const char *name, int64_t rows, int64_t cols, const kvc_expert *x,
                                kvc_src *out) {
    const weights *w = file;
    kvc_status st;
    const st_tensor *t = find(w, name, &st);
    if (st != KVC_OK) return st;
    const char *experts = x ? strstr(name, "experts.") : NULL;
    if (!t && experts) { /* transformers 5 keeps a layer's experts as 3-D tensors in memory; its files have one per expert */
        char fused[256];
        snprintf(fused, sizeof fused, "%.*sgate_up_proj", (int)(experts - name) + 8, name);
        if (find(w, fused, &st) || st != KVC_OK)
            return st != KVC_OK ? st : kvc_fail(KVC_ERR_UNSUPPORTED, "tensor '%s': fused 3-D expert tensors are not supported "
                                               "(save the model with save_pretrained, which writes one tensor per expert)", fused);
    }
    if (!t) {
        if (w->weight_map) return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' is missing from %s", name, w->index_path);
        return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' is missing from the safetensors files in '%s'", name, w->dir);
    }
    const int64_t want[2] = {rows ? rows : cols, cols};
    const int nd = rows ? 2 : 1;
    const int ok = t->n_dims == nd && t->shape[0] == want[0] && (nd == 1 || t->shape[1] == want[1]);
    if (!ok) {
        char e[64], f[200];
        shape_str(rows ? want : want + 1, nd, e, sizeof e);
        shape_str(t->shape, t->n_dims, f, sizeof f);
        return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' has shape %s, but config.json implies %s", name, f, e);
    }
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "tensor '%s' has dtype %s; only F32, F16 and BF16 weights are supported",
                        t->name, t->dtype_name);
    memset(out, 0, sizeof *out);
    out->name = t->name;
    out->rows = rows ? rows : 1;
    out->cols = cols;
    out->decode = decode_rows;
    out->data = t->data;
    out->row_bytes = t->nbytes / (size_t)out->rows;
    out->ctx = t;
    /* their bytes are ggml's F32/F16/BF16 rows */
    out->ggml_type = t->dtype == ST_F32 ? GGML_T_F32 : t->dtype == ST_F16 ? GGML_T_F16 : GGML_T_BF16;
    return KVC_OK;
}

/* Tensor `name` streamed into the weight of `role`. */
static kvc_status put(const void *file, kvc_model *m, kvc_weight_role role, int32_t layer, const char *name, int64_t rows,
                      int64_t cols, const kvc_expert *x) {
    kvc_src src;
    KVC_TRY(tensor_source(file, name, rows, cols, x, &src));
    return kvc_model_put(m, role, layer, x ? x->e : -1, &src);
}

static kvc_status load_weights(const weights *w, kvc_model *m) {
    const kvc_config *c = &m->cfg;
    const int64_t D = c->hidden, V = c->vocab;
    KVC_TRY(put(w, m, KVC_W_TOK, 0, "model.embed_tokens.weight", V, D, NULL));
    KVC_TRY(put(w, m, KVC_W_OUT_NORM, 0, "model.norm.weight", 0, D, NULL));
    if (!c->tied_embeddings) {
        kvc_status st;
        if (!find(w, "lm_head.weight", &st) && st == KVC_OK)
            return kvc_fail(KVC_ERR_FORMAT, "tensor 'lm_head.weight' is missing although config.json sets "
                            "tie_word_embeddings = false");
        KVC_TRY(st);
        KVC_TRY(put(w, m, KVC_W_LM_HEAD, 0, "lm_head.weight", V, D, NULL));
    }
    return kvc_model_put_layers(m, 1, put, w);
}

/* ---------------------------------------------------------------------------------------------- */

kvc_status kvc_load_hf(const char *dir, const kvc_backend *be, int32_t wmode, kvc_model **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_load_hf: out is NULL");
    *out = NULL;
    if (!dir || !*dir) return kvc_fail(KVC_ERR_ARG, "kvc_load_hf: empty folder name");
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return kvc_fail(KVC_ERR_IO, "'%s' is not a folder: a Hugging Face model folder needs config.json and *.safetensors", dir);
    char *cfg_path = join(dir, "config.json");
    if (!cfg_path) return KVC_ERR_NOMEM;
    if (!is_file(cfg_path)) {
        free(cfg_path);
        return kvc_fail(KVC_ERR_IO, "no config.json in %s: a Hugging Face model folder needs config.json and *.safetensors", dir);
    }
    json_value *j = NULL;
    kvc_config cfg;
    longrope lr;
    kvc_status st = parse_json_file(cfg_path, &j);
    int multimodal = 0;
    if (st == KVC_OK) {
        cfg_reader r = {j, cfg_path, NULL};
        const json_value *mt = j->kind == JSON_OBJECT ? json_get(j, "model_type") : NULL;
        if (mt && mt->kind == JSON_STRING && !strcmp(mt->string, "gemma3")) { /* Gemma3ForConditionalGeneration: its text model */
            const json_value *tc = json_get(j, "text_config");
            if (!tc || tc->kind != JSON_OBJECT)
                st = kvc_fail(KVC_ERR_FORMAT, "%s: a 'gemma3' config needs a 'text_config' object", cfg_path);
            r = (cfg_reader){tc, cfg_path, j};
            multimodal = 1;
        }
        if (st == KVC_OK) st = read_config(&r, &cfg, &lr);
    }
    json_free(j);
    free(cfg_path);
    if (st != KVC_OK) return st;

    weights *w = calloc(1, sizeof *w);
    if (!w) return kvc_fail(KVC_ERR_NOMEM, "out of memory: weight files");
    w->dir = dir;
    w->multimodal = multimodal;
    kvc_model *m = NULL;
    st = open_weights(w);
    if (st == KVC_OK && cfg.tied_embeddings < 0) {
        const st_tensor *head = find(w, "lm_head.weight", &st);
        cfg.tied_embeddings = head == NULL;
    }
    if (st == KVC_OK) st = kvc_model_create(&cfg, "safetensors", dir, be, wmode, 1, tensor_source, w, &m);
    if (st != KVC_OK) {
        kvc_model_free(m);
        weights_free(w);
        return st;
    }
    const int gemma = cfg.arch == KVC_ARCH_GEMMA2 || cfg.arch == KVC_ARCH_GEMMA3;
    m->norm_plus_one = gemma; /* transformers' Gemma RMSNorm (Gemma 2 and 3): x / rms(x) * (1 + w) */
    m->embed_scale_rounded = gemma; /* and its scale in the embedding's dtype */
    st = load_weights(w, m);
    if (st == KVC_OK && lr.linear > 0) { /* "linear" scaling as per-frequency divisors, for kvc_model_finish */
        float *f = kvc_model_rope_factors(m);
        if (!f) st = KVC_ERR_NOMEM;
        for (int32_t i = 0; i < cfg.head_dim / 2 && st == KVC_OK; i++) f[i] = (float)lr.linear;
    }
    if (st == KVC_OK && cfg.rope_long_context > 0) { /* LongRoPE's factors, for kvc_model_finish */
        float *sf = kvc_model_rope_factors(m), *lf = kvc_model_rope_long_factors(m);
        const int32_t n = (cfg.rope_dim > 0 ? cfg.rope_dim : cfg.head_dim) / 2;
        if (!sf || !lf) st = KVC_ERR_NOMEM;
        for (int32_t i = 0; i < n && st == KVC_OK; i++) {
            sf[i] = lr.short_f[i];
            lf[i] = lr.long_f[i];
        }
    }
    if (st == KVC_OK) st = kvc_model_finish(m);
    if (st == KVC_OK && m->mapped_bytes == 0) {
        weights_free(w); /* every weight was copied: the files go now */
    } else {
        /* weights used in place point into the mappings: the model closes them once, after its buffers
         * (on the error path too, just below) */
        w->dir = NULL; /* the caller's string */
        m->files = w;
        m->close_files = weights_free;
    }
    if (st != KVC_OK) {
        kvc_model_free(m);
        return st;
    }
    *out = m;
    return KVC_OK;
}
