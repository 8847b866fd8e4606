/* Build a kvc_model from a Hugging Face folder: config.json, then model.safetensors or the shards
 * named by model.safetensors.index.json (else every *.safetensors in the folder). */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "model.h"
#include "safetensors.h"

#define MAX_SHARDS 256

typedef struct shards {
    st_file *files[MAX_SHARDS];
    int n;
} shards;

static kvc_status read_file(const char *path, char **out, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || sb.st_size > (64 << 20)) {
        fclose(fp);
        return kvc_fail(KVC_ERR_FORMAT, "'%s' is unreadable or larger than 64 MiB", path);
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fclose(fp);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory reading '%s'", path);
    }
    size_t n = fread(buf, 1, (size_t)sb.st_size, fp);
    fclose(fp);
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return KVC_OK;
}

static kvc_status parse_json_file(const char *path, json_value **out) {
    char *text;
    size_t len;
    KVC_TRY(read_file(path, &text, &len));
    kvc_status st = json_parse(text, len, path, out);
    free(text);
    return st;
}

/* Integer field with range check; `def` when absent or null (required: error when absent). */
static kvc_status get_int(const json_value *cfg, const char *key, int64_t def, int required, int64_t lo, int64_t hi, int32_t *out) {
    const json_value *v = json_get(cfg, key);
    if (!v || v->kind == JSON_NULL) {
        if (required) return kvc_fail(KVC_ERR_FORMAT, "config.json: '%s' is missing", key);
        *out = (int32_t)def;
        return KVC_OK;
    }
    if (v->kind != JSON_NUMBER || v->number != floor(v->number) || v->number < lo || v->number > hi)
        return kvc_fail(KVC_ERR_FORMAT, "config.json: '%s' must be an integer in [%lld, %lld]", key, (long long)lo, (long long)hi);
    *out = (int32_t)v->number;
    return KVC_OK;
}

static kvc_status get_float(const json_value *cfg, const char *key, double def, double *out) {
    const json_value *v = json_get(cfg, key);
    if (!v || v->kind == JSON_NULL) {
        *out = def;
        return KVC_OK;
    }
    if (v->kind != JSON_NUMBER) return kvc_fail(KVC_ERR_FORMAT, "config.json: '%s' must be a number", key);
    *out = v->number;
    return KVC_OK;
}

static kvc_status read_config(const json_value *j, kvc_config *c) {
    kvc_config_defaults(c);
    if (j->kind != JSON_OBJECT) return kvc_fail(KVC_ERR_FORMAT, "config.json is not a JSON object");
    const json_value *mt = json_get(j, "model_type");
    if (!mt || mt->kind != JSON_STRING) return kvc_fail(KVC_ERR_FORMAT, "config.json: 'model_type' is missing");
    if (!strcmp(mt->string, "llama")) c->arch = KVC_ARCH_LLAMA;
    else if (!strcmp(mt->string, "mistral")) c->arch = KVC_ARCH_MISTRAL;
    else if (!strcmp(mt->string, "qwen2")) c->arch = KVC_ARCH_QWEN2;
    else return kvc_fail(KVC_ERR_UNSUPPORTED, "model_type '%s' is not supported (llama, mistral, qwen2 are)", mt->string);
    KVC_TRY(get_int(j, "num_hidden_layers", 0, 1, 1, 4096, &c->n_layers));
    KVC_TRY(get_int(j, "hidden_size", 0, 1, 1, 65536, &c->hidden));
    KVC_TRY(get_int(j, "num_attention_heads", 0, 1, 1, 1024, &c->n_heads));
    KVC_TRY(get_int(j, "num_key_value_heads", c->n_heads, 0, 1, 1024, &c->n_kv_heads));
    KVC_TRY(get_int(j, "head_dim", c->hidden / c->n_heads, 0, 1, 1024, &c->head_dim));
    KVC_TRY(get_int(j, "intermediate_size", 0, 1, 1, 1 << 20, &c->ffn));
    KVC_TRY(get_int(j, "vocab_size", 0, 1, 1, 1 << 24, &c->vocab));
    KVC_TRY(get_int(j, "max_position_embeddings", 0, 0, 0, INT32_MAX, &c->max_context));
    double x;
    KVC_TRY(get_float(j, "rms_norm_eps", 1e-6, &x));
    c->rms_eps = (float)x;
    const json_value *rp = json_get(j, "rope_parameters"); /* newer transformers nest RoPE settings here */
    const json_value *rs = json_get(j, "rope_scaling");
    if (!rs || rs->kind == JSON_NULL) rs = rp;
    KVC_TRY(get_float(j, "rope_theta", rp && rp->kind == JSON_OBJECT && json_get(rp, "rope_theta") ? json_get(rp, "rope_theta")->number : 10000.0, &x));
    c->rope_theta = (float)x;
    if (rs && rs->kind == JSON_OBJECT) {
        const json_value *t = json_get(rs, "rope_type");
        if (!t) t = json_get(rs, "type");
        const char *type = t && t->kind == JSON_STRING ? t->string : "default";
        if (!strcmp(type, "llama3")) {
            double f, lo, hi, old;
            KVC_TRY(get_float(rs, "factor", 0, &f));
            KVC_TRY(get_float(rs, "low_freq_factor", 1, &lo));
            KVC_TRY(get_float(rs, "high_freq_factor", 4, &hi));
            KVC_TRY(get_float(rs, "original_max_position_embeddings", 8192, &old));
            c->rope_scaling_factor = (float)f;
            c->rope_low_freq_factor = (float)lo;
            c->rope_high_freq_factor = (float)hi;
            c->rope_original_context = (int32_t)old;
        } else if (strcmp(type, "default") != 0) {
            return kvc_fail(KVC_ERR_UNSUPPORTED, "rope scaling '%s' is not supported (llama3 is)", type);
        }
    }
    /* tie_word_embeddings: transformers defaults to true for qwen2's small models only when written;
     * when absent we decide from the weights (no lm_head.weight -> tied) */
    const json_value *tie = json_get(j, "tie_word_embeddings");
    c->tied_embeddings = tie && tie->kind == JSON_BOOL ? tie->boolean : -1;
    c->qkv_bias = c->arch == KVC_ARCH_QWEN2;
    const json_value *bos = json_get(j, "bos_token_id"), *eos = json_get(j, "eos_token_id");
    if (bos && bos->kind == JSON_NUMBER) c->bos_id = (int32_t)bos->number;
    if (eos && eos->kind == JSON_ARRAY && eos->n > 0 && eos->items[0].kind == JSON_NUMBER) c->eos_id = (int32_t)eos->items[0].number;
    else if (eos && eos->kind == JSON_NUMBER) c->eos_id = (int32_t)eos->number;
    /* Mistral's sliding window only matters beyond its length; prompts here are checked in Python */
    return KVC_OK;
}

static void close_shards(shards *s) {
    for (int i = 0; i < s->n; i++) st_close(s->files[i]);
    s->n = 0;
}

static kvc_status add_shard(shards *s, const char *dir, const char *name) {
    for (int i = 0; i < s->n; i++) (void)0;
    if (s->n >= MAX_SHARDS) return kvc_fail(KVC_ERR_UNSUPPORTED, "more than %d safetensors shards", MAX_SHARDS);
    if (strchr(name, '/') || strstr(name, "..")) return kvc_fail(KVC_ERR_FORMAT, "shard name '%s' is not a plain file name", name);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    KVC_TRY(st_open(path, &s->files[s->n]));
    s->n++;
    return KVC_OK;
}

static kvc_status open_shards(const char *dir, shards *s) {
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (stat(path, &sb) == 0) {
        json_value *idx;
        KVC_TRY(parse_json_file(path, &idx));
        const json_value *wm = json_get(idx, "weight_map");
        kvc_status st = (!wm || wm->kind != JSON_OBJECT) ? kvc_fail(KVC_ERR_FORMAT, "%s has no 'weight_map' object", path) : KVC_OK;
        /* open each distinct shard once */
        const char *names[MAX_SHARDS];
        int nn = 0;
        for (size_t i = 0; st == KVC_OK && i < wm->n; i++) {
            if (wm->items[i].kind != JSON_STRING) { st = kvc_fail(KVC_ERR_FORMAT, "%s: weight_map values must be file names", path); break; }
            int seen = 0;
            for (int k = 0; k < nn; k++) seen |= !strcmp(names[k], wm->items[i].string);
            if (seen) continue;
            if (nn >= MAX_SHARDS) { st = kvc_fail(KVC_ERR_UNSUPPORTED, "more than %d shards", MAX_SHARDS); break; }
            names[nn++] = wm->items[i].string;
            st = add_shard(s, dir, wm->items[i].string);
        }
        json_free(idx);
        return st;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (stat(path, &sb) == 0) return add_shard(s, dir, "model.safetensors");
    DIR *d = opendir(dir);
    if (!d) return kvc_fail(KVC_ERR_IO, "cannot list '%s': %s", dir, strerror(errno));
    struct dirent *e;
    kvc_status st = KVC_OK;
    while (st == KVC_OK && (e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l > 12 && !strcmp(e->d_name + l - 12, ".safetensors")) st = add_shard(s, dir, e->d_name);
    }
    closedir(d);
    if (st == KVC_OK && s->n == 0)
        st = kvc_fail(KVC_ERR_IO, "no *.safetensors weights in '%s': a Hugging Face folder needs config.json and safetensors files", dir);
    return st;
}

static const st_tensor *find(const shards *s, const char *name) {
    for (int i = 0; i < s->n; i++) {
        const st_tensor *t = st_find(s->files[i], name);
        if (t) return t;
    }
    return NULL;
}

static kvc_status load(const shards *s, const char *name, int64_t rows, int64_t cols, float *dst) {
    const st_tensor *t = find(s, name);
    if (!t) return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' is missing from the safetensors files", name);
    const int ok = rows == 1 ? (t->n_dims == 1 && t->shape[0] == cols) : (t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!ok)
        return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld] (%d dims), expected [%lld, %lld] from config.json", name,
                        (long long)t->shape[0], (long long)(t->n_dims > 1 ? t->shape[1] : 0), t->n_dims, (long long)rows, (long long)cols);
    return st_to_f32(t, dst);
}

static kvc_status load_weights(const shards *s, kvc_model *m) {
    const kvc_config *c = &m->cfg;
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    KVC_TRY(load(s, "model.embed_tokens.weight", c->vocab, D, m->tok_embd));
    KVC_TRY(load(s, "model.norm.weight", 1, D, m->out_norm));
    if (!c->tied_embeddings) KVC_TRY(load(s, "lm_head.weight", c->vocab, D, m->lm_head));
    char name[128];
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_layer_weights *L = &m->layers[l];
#define LOAD(suffix, rows, cols, dst)                                     \
    do {                                                                  \
        snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);     \
        KVC_TRY(load(s, name, rows, cols, dst));                          \
    } while (0)
        LOAD("input_layernorm.weight", 1, D, L->attn_norm);
        LOAD("self_attn.q_proj.weight", qd, D, L->wq);
        LOAD("self_attn.k_proj.weight", kd, D, L->wk);
        LOAD("self_attn.v_proj.weight", kd, D, L->wv);
        LOAD("self_attn.o_proj.weight", D, qd, L->wo);
        if (c->qkv_bias) {
            LOAD("self_attn.q_proj.bias", 1, qd, L->bq);
            LOAD("self_attn.k_proj.bias", 1, kd, L->bk);
            LOAD("self_attn.v_proj.bias", 1, kd, L->bv);
        }
        LOAD("post_attention_layernorm.weight", 1, D, L->ffn_norm);
        LOAD("mlp.gate_proj.weight", F, D, L->w_gate);
        LOAD("mlp.up_proj.weight", F, D, L->w_up);
        LOAD("mlp.down_proj.weight", D, F, L->w_down);
#undef LOAD
    }
    return KVC_OK;
}

kvc_status kvc_load_hf(const char *dir, kvc_model **out) {
    *out = NULL;
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (stat(path, &sb) != 0)
        return kvc_fail(KVC_ERR_IO, "no config.json in '%s': a Hugging Face model folder needs config.json and *.safetensors", dir);
    json_value *j;
    KVC_TRY(parse_json_file(path, &j));
    kvc_config cfg;
    kvc_status st = read_config(j, &cfg);
    json_free(j);
    if (st != KVC_OK) return st;
    shards s = {{0}, 0};
    st = open_shards(dir, &s);
    kvc_model *m = NULL;
    if (st == KVC_OK) {
        if (cfg.tied_embeddings < 0) cfg.tied_embeddings = find(&s, "lm_head.weight") == NULL;
        st = kvc_model_alloc(&cfg, "safetensors", &m);
    }
    if (st == KVC_OK) st = load_weights(&s, m);
    if (st == KVC_OK) st = kvc_model_finish(m);
    close_shards(&s);
    if (st != KVC_OK) {
        kvc_model_free(m);
        return st;
    }
    *out = m;
    return KVC_OK;
}
