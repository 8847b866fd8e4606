/* Build a kvc_model from a GGUF file: config from the metadata, tensors by llama.cpp's names,
 * shapes checked, weights dequantised to fp32. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dequant.h"
#include "gguf.h"
#include "model.h"

static kvc_status arch_of(const gguf_file *f, char *arch, size_t cap, int32_t *code) {
    int64_t i = gguf_find_kv(f, "general.architecture");
    if (i < 0) return kvc_fail(KVC_ERR_FORMAT, "GGUF: general.architecture is missing; the file may be corrupt");
    const char *s;
    uint64_t len;
    KVC_TRY(gguf_kv_string(f, i, 0, &s, &len));
    if (len >= cap) len = cap - 1;
    memcpy(arch, s, len);
    arch[len] = '\0';
    if (!strcmp(arch, "llama")) *code = KVC_ARCH_LLAMA;
    else if (!strcmp(arch, "mistral")) *code = KVC_ARCH_MISTRAL;
    else if (!strcmp(arch, "qwen2")) *code = KVC_ARCH_QWEN2;
    else return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF architecture '%s' is not supported (llama, mistral, qwen2 are)", arch);
    return KVC_OK;
}

/* Read `{arch}.{suffix}` as an int, required or with a default. */
static kvc_status arch_int(const gguf_file *f, const char *arch, const char *suffix, int64_t def, int required, int64_t *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    *out = def;
    if (required) return gguf_get_int(f, key, out);
    return gguf_get_int_opt(f, key, out);
}

static kvc_status to_i32(int64_t v, const char *what, int32_t *out) {
    if (v < INT32_MIN || v > INT32_MAX) return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s = %lld is out of range", what, (long long)v);
    *out = (int32_t)v;
    return KVC_OK;
}

static kvc_status read_config(const gguf_file *f, kvc_config *c) {
    char arch[32];
    kvc_config_defaults(c);
    KVC_TRY(arch_of(f, arch, sizeof arch, &c->arch));
    int64_t v;
    KVC_TRY(arch_int(f, arch, "block_count", 0, 1, &v));
    KVC_TRY(to_i32(v, "block_count", &c->n_layers));
    KVC_TRY(arch_int(f, arch, "embedding_length", 0, 1, &v));
    KVC_TRY(to_i32(v, "embedding_length", &c->hidden));
    KVC_TRY(arch_int(f, arch, "attention.head_count", 0, 1, &v));
    KVC_TRY(to_i32(v, "attention.head_count", &c->n_heads));
    KVC_TRY(arch_int(f, arch, "attention.head_count_kv", c->n_heads, 0, &v));
    KVC_TRY(to_i32(v, "attention.head_count_kv", &c->n_kv_heads));
    KVC_TRY(arch_int(f, arch, "feed_forward_length", 0, 1, &v));
    KVC_TRY(to_i32(v, "feed_forward_length", &c->ffn));
    KVC_TRY(arch_int(f, arch, "context_length", 0, 0, &v));
    KVC_TRY(to_i32(v, "context_length", &c->max_context));
    if (c->n_heads <= 0) return kvc_fail(KVC_ERR_FORMAT, "GGUF: attention.head_count = %d", c->n_heads);
    int64_t hd = c->hidden / c->n_heads;
    KVC_TRY(arch_int(f, arch, "attention.key_length", hd, 0, &hd));
    KVC_TRY(arch_int(f, arch, "rope.dimension_count", hd, 0, &v));
    if (v != hd) return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: partial rotary embeddings (rope.dimension_count %lld != head_dim %lld) are not supported", (long long)v, (long long)hd);
    KVC_TRY(to_i32(hd, "head_dim", &c->head_dim));
    char key[160];
    double x = c->rope_theta;
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    KVC_TRY(gguf_get_float_opt(f, key, &x));
    c->rope_theta = (float)x;
    x = c->rms_eps;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    KVC_TRY(gguf_get_float_opt(f, key, &x));
    c->rms_eps = (float)x;
    /* vocabulary: metadata, else the tokenizer's list, else the embedding's shape */
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb) return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor token_embd.weight is missing; the file may be corrupt");
    v = emb->n_dims == 2 ? emb->ne[1] : 0;
    KVC_TRY(arch_int(f, arch, "vocab_size", v, 0, &v));
    KVC_TRY(to_i32(v, "vocab_size", &c->vocab));
    c->rope_pairing = c->arch == KVC_ARCH_QWEN2 ? KVC_ROPE_HALF : KVC_ROPE_ADJACENT;
    c->tied_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    c->qkv_bias = gguf_find_tensor(f, "blk.0.attn_q.bias") != NULL;
    v = -1;
    KVC_TRY(gguf_get_int_opt(f, "tokenizer.ggml.bos_token_id", &v));
    KVC_TRY(to_i32(v, "bos_token_id", &c->bos_id));
    v = -1;
    KVC_TRY(gguf_get_int_opt(f, "tokenizer.ggml.eos_token_id", &v));
    KVC_TRY(to_i32(v, "eos_token_id", &c->eos_id));
    return KVC_OK;
}

/* Dequantise tensor `name` (ggml shape ne0 = cols, ne1 = rows) into dst after checking its shape. */
static kvc_status load_tensor(const gguf_file *f, const char *name, int64_t rows, int64_t cols, float *dst) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' is missing; the file may be corrupt or from another architecture", name);
    const int64_t want_ne1 = rows;
    const int ok = (rows == 1) ? (t->n_elements == cols && t->ne[0] == cols)
                               : (t->n_dims == 2 && t->ne[0] == cols && t->ne[1] == want_ne1);
    if (!ok)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has shape [%lld, %lld], expected [%lld, %lld] (ggml order) for this config",
                        name, (long long)t->ne[0], (long long)t->ne[1], (long long)cols, (long long)rows);
    if (!t->data)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: tensor '%s' has type %d, which is not supported (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)",
                        name, t->type);
    kvc_status st = ggml_dequantize(t->type, t->data, t->nbytes, dst, t->n_elements);
    if (st != KVC_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvc_last_error());
        return kvc_fail(st, "GGUF: tensor '%s': %s", name, msg);
    }
    return KVC_OK;
}

static kvc_status load_weights(const gguf_file *f, kvc_model *m) {
    const kvc_config *c = &m->cfg;
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    KVC_TRY(load_tensor(f, "token_embd.weight", c->vocab, D, m->tok_embd));
    KVC_TRY(load_tensor(f, "output_norm.weight", 1, D, m->out_norm));
    if (!c->tied_embeddings) KVC_TRY(load_tensor(f, "output.weight", c->vocab, D, m->lm_head));
    char name[96];
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_layer_weights *L = &m->layers[l];
#define LOAD(suffix, rows, cols, dst)                                   \
    do {                                                                \
        snprintf(name, sizeof name, "blk.%d.%s", l, suffix);            \
        KVC_TRY(load_tensor(f, name, rows, cols, dst));                 \
    } while (0)
        LOAD("attn_norm.weight", 1, D, L->attn_norm);
        LOAD("attn_q.weight", qd, D, L->wq);
        LOAD("attn_k.weight", kd, D, L->wk);
        LOAD("attn_v.weight", kd, D, L->wv);
        LOAD("attn_output.weight", D, qd, L->wo);
        if (c->qkv_bias) {
            LOAD("attn_q.bias", 1, qd, L->bq);
            LOAD("attn_k.bias", 1, kd, L->bk);
            LOAD("attn_v.bias", 1, kd, L->bv);
        }
        LOAD("ffn_norm.weight", 1, D, L->ffn_norm);
        LOAD("ffn_gate.weight", F, D, L->w_gate);
        LOAD("ffn_up.weight", F, D, L->w_up);
        LOAD("ffn_down.weight", D, F, L->w_down);
#undef LOAD
    }
    if (gguf_find_tensor(f, "rope_freqs.weight")) {
        /* Llama-3.1 frequency scaling, stored by the converter as per-frequency divisors */
        m->rope_factors = kvc_model_alloc_floats(m, (size_t)c->head_dim / 2, "rope factors");
        if (!m->rope_factors) return KVC_ERR_NOMEM;
        KVC_TRY(load_tensor(f, "rope_freqs.weight", 1, c->head_dim / 2, m->rope_factors));
    }
    return KVC_OK;
}

kvc_status kvc_load_gguf(const char *path, kvc_model **out) {
    *out = NULL;
    gguf_file *f = NULL;
    KVC_TRY(gguf_open(path, &f));
    kvc_config cfg;
    kvc_model *m = NULL;
    kvc_status st = read_config(f, &cfg);
    if (st == KVC_OK) st = kvc_model_alloc(&cfg, "gguf", &m);
    if (st == KVC_OK) st = load_weights(f, m);
    if (st == KVC_OK) st = kvc_model_finish(m);
    if (st != KVC_OK) {
        kvc_model_free(m);
        gguf_close(f);
        return st;
    }
    m->meta = f; /* kept for the tokenizer's metadata; closed by kvc_model_free */
    *out = m;
    return KVC_OK;
}
