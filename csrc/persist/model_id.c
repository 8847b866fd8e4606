/* A model's identity: its configuration as JSON and the digest of its weight files (model_id.h). */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../model/json.h"
#include "model_id.h"
#include "sha256.h"

/* Every field of kvc_config, by name: the one list the JSON and its check walk. */
typedef struct field { const char *name; size_t off; int is_float; } field;
#define I(f) {#f, offsetof(kvc_config, f), 0}
#define F(f) {#f, offsetof(kvc_config, f), 1}
static const field FIELDS[] = {I(arch), I(n_layers), I(hidden), I(n_heads), I(n_kv_heads), I(head_dim), I(ffn), I(vocab),
                               I(max_context), I(rope_pairing), I(tied_embeddings), I(qkv_bias), F(rms_eps),
                               F(rope_theta), F(rope_scaling_factor), F(rope_low_freq_factor), F(rope_high_freq_factor),
                               I(rope_original_context), I(bos_id), I(eos_id), I(qk_norm), I(sliding_window),
                               I(window_first_layer)};
#undef I
#undef F
#define N_FIELDS (sizeof FIELDS / sizeof *FIELDS)

static double value_of(const kvc_config *c, const field *f) {
    const char *p = (const char *)c + f->off;
    if (f->is_float) {
        float x;
        memcpy(&x, p, sizeof x);
        return x;
    }
    int32_t i;
    memcpy(&i, p, sizeof i);
    return i;
}

char *kvc_model_id_config_json(const kvc_config *c) {
    const size_t cap = N_FIELDS * 64 + 4;
    char *out = malloc(cap);
    if (!out) return NULL;
    size_t n = 0;
    out[n++] = '{';
    for (size_t i = 0; i < N_FIELDS; i++) /* %.9g round-trips a float exactly */
        n += (size_t)snprintf(out + n, cap - n, "%s\"%s\":%.9g", i ? "," : "", FIELDS[i].name, value_of(c, &FIELDS[i]));
    snprintf(out + n, cap - n, "}");
    return out;
}

kvc_status kvc_model_id_check_config(const kvc_config *c, const char *text, const char *what) {
    json_value *v = NULL;
    if (json_parse(text, strlen(text), what, &v) != KVC_OK || v->kind != JSON_OBJECT) {
        json_free(v);
        return kvc_fail(KVC_ERR_FORMAT, "%s: its model configuration is not a JSON object; the file is corrupt", what);
    }
    kvc_status st = KVC_OK;
    for (size_t i = 0; i < N_FIELDS && st == KVC_OK; i++) {
        const json_value *x = json_get(v, FIELDS[i].name);
        const double here = value_of(c, &FIELDS[i]);
        if (!x || x->kind != JSON_NUMBER)
            st = kvc_fail(KVC_ERR_FORMAT, "%s: its model configuration has no number '%s'; the file is corrupt", what,
                          FIELDS[i].name);
        else if ((FIELDS[i].is_float ? (double)(float)x->number : x->number) != here)
            st = kvc_fail(KVC_ERR_FORMAT, "%s was saved from a different model: %s is %.9g in the file, %.9g in this model",
                          what, FIELDS[i].name, x->number, here);
    }
    json_free(v);
    return st;
}

static kvc_status hash_file(kvc_sha256 *h, const char *path, uint8_t *buf, size_t cap) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return kvc_fail(KVC_ERR_IO, "cannot read the model file '%s' for its digest: %s", path, strerror(errno));
    size_t got;
    while ((got = fread(buf, 1, cap, fp)) > 0) kvc_sha256_update(h, buf, got);
    const int bad = ferror(fp);
    fclose(fp);
    return bad ? kvc_fail(KVC_ERR_IO, "cannot read the model file '%s' for its digest", path) : KVC_OK;
}

static int is_shard(const struct dirent *e) {
    const size_t l = strlen(e->d_name);
    return l > 12 && strcmp(e->d_name + l - 12, ".safetensors") == 0;
}

/* The weight files' bytes, in order: the GGUF file, or every *.safetensors of the folder sorted by name. */
static kvc_status digest_files(const kvc_model *m, char hex[65]) {
    const size_t cap = (size_t)4 << 20;
    uint8_t *buf = malloc(cap);
    if (!buf) return kvc_fail(KVC_ERR_NOMEM, "out of memory: model digest");
    kvc_sha256 h;
    kvc_sha256_init(&h);
    kvc_status st = KVC_OK;
    if (strcmp(m->format, "gguf") == 0) {
        st = hash_file(&h, m->path, buf, cap);
    } else {
        struct dirent **names = NULL;
        const int n = scandir(m->path, &names, is_shard, alphasort);
        if (n < 0) st = kvc_fail(KVC_ERR_IO, "cannot list the model folder '%s': %s", m->path, strerror(errno));
        for (int i = 0; i < n; i++) {
            char path[4096];
            if (st == KVC_OK) {
                snprintf(path, sizeof path, "%s/%s", m->path, names[i]->d_name);
                st = hash_file(&h, path, buf, cap);
            }
            free(names[i]);
        }
        free(names);
    }
    free(buf);
    if (st == KVC_OK) kvc_sha256_hex(&h, hex);
    return st;
}

kvc_status kvc_model_id_digest(kvc_model *m, char out[72]) {
    pthread_mutex_lock(&m->host_lock);
    kvc_status st = KVC_OK;
    if (!m->digest[0]) {
        char hex[65];
        st = digest_files(m, hex);
        if (st == KVC_OK) snprintf(m->digest, sizeof m->digest, "sha256:%s", hex);
    }
    if (st == KVC_OK) memcpy(out, m->digest, sizeof m->digest);
    pthread_mutex_unlock(&m->host_lock);
    return st;
}
