/* kvc_model: allocation of the weight buffers for a config, RoPE frequencies, format dispatch. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "../backend/cuda_loader.h"
#include "gguf.h"
#include "model.h"

void kvc_config_defaults(kvc_config *c) {
    memset(c, 0, sizeof *c);
    c->arch = KVC_ARCH_LLAMA;
    c->rope_pairing = KVC_ROPE_HALF;
    c->rms_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->bos_id = -1;
    c->eos_id = -1;
}

static void *own(kvc_model *m, size_t bytes, const char *what) {
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **p = realloc(m->owned, cap * sizeof *p);
        if (!p) {
            kvc_fail(KVC_ERR_NOMEM, "out of memory: model buffer list");
            return NULL;
        }
        m->owned = p;
        m->cap_owned = cap;
    }
    void *p = kvc_malloc(bytes, what);
    if (p) m->owned[m->n_owned++] = p;
    return p;
}

float *kvc_model_alloc_floats(kvc_model *m, size_t n, const char *what) {
    size_t bytes;
    if (kvc_mul_ok(n, sizeof(float), &bytes) != 0) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: %s (%zu floats)", what, n);
        return NULL;
    }
    float *p = own(m, bytes, what);
    if (p) m->weight_bytes += bytes;
    return p;
}

static kvc_status check_config(const kvc_config *c) {
#define REQUIRE(cond, ...) \
    if (!(cond)) return kvc_fail(KVC_ERR_FORMAT, "invalid model config: " __VA_ARGS__)
    REQUIRE(c->arch >= KVC_ARCH_LLAMA && c->arch <= KVC_ARCH_QWEN2, "unknown architecture %d", c->arch);
    REQUIRE(c->n_layers > 0 && c->n_layers <= 4096, "n_layers = %d", c->n_layers);
    REQUIRE(c->hidden > 0 && c->hidden <= 65536, "hidden size = %d", c->hidden);
    REQUIRE(c->n_heads > 0 && c->n_heads <= 1024, "n_heads = %d", c->n_heads);
    REQUIRE(c->n_kv_heads > 0 && c->n_kv_heads <= c->n_heads, "n_kv_heads = %d (n_heads = %d)", c->n_kv_heads, c->n_heads);
    REQUIRE(c->n_heads % c->n_kv_heads == 0, "n_heads (%d) is not a multiple of n_kv_heads (%d)", c->n_heads, c->n_kv_heads);
    REQUIRE(c->head_dim > 0 && c->head_dim <= 256 && c->head_dim % 2 == 0, "head_dim = %d (must be even, at most 256)", c->head_dim);
    REQUIRE((int64_t)c->n_heads * c->head_dim <= 262144, "n_heads * head_dim too large");
    REQUIRE(c->ffn > 0 && c->ffn <= 1 << 20, "intermediate size = %d", c->ffn);
    REQUIRE(c->vocab > 0 && c->vocab <= 1 << 24, "vocab size = %d", c->vocab);
    REQUIRE(c->rope_pairing == KVC_ROPE_HALF || c->rope_pairing == KVC_ROPE_ADJACENT, "rope pairing %d", c->rope_pairing);
    REQUIRE(isfinite(c->rms_eps) && c->rms_eps > 0 && c->rms_eps < 1, "rms_norm_eps = %g", c->rms_eps);
    REQUIRE(isfinite(c->rope_theta) && c->rope_theta > 1, "rope_theta = %g", c->rope_theta);
    REQUIRE(isfinite(c->rope_scaling_factor) && c->rope_scaling_factor >= 0, "rope scaling factor = %g", c->rope_scaling_factor);
    if (c->rope_scaling_factor > 0) {
        REQUIRE(c->rope_original_context > 0, "llama3 rope scaling needs original_max_position_embeddings");
        REQUIRE(c->rope_high_freq_factor > c->rope_low_freq_factor && c->rope_low_freq_factor > 0,
                "llama3 rope scaling needs high_freq_factor > low_freq_factor > 0");
    }
    REQUIRE(c->bos_id < c->vocab && c->eos_id < c->vocab, "bos/eos token id outside the vocabulary");
#undef REQUIRE
    return KVC_OK;
}

kvc_status kvc_model_alloc(const kvc_config *cfg, const char *format, kvc_model **out) {
    *out = NULL;
    KVC_TRY(check_config(cfg));
    kvc_model *m = calloc(1, sizeof *m);
    if (!m) return kvc_fail(KVC_ERR_NOMEM, "out of memory: model");
    m->cfg = *cfg;
    snprintf(m->format, sizeof m->format, "%s", format);
    const size_t D = cfg->hidden, F = cfg->ffn, V = cfg->vocab;
    const size_t qd = (size_t)cfg->n_heads * cfg->head_dim, kd = (size_t)cfg->n_kv_heads * cfg->head_dim;
    m->layers = own(m, sizeof(kvc_layer_weights) * cfg->n_layers, "layer table");
    if (!m->layers) goto fail;
    memset(m->layers, 0, sizeof(kvc_layer_weights) * cfg->n_layers);
#define ALLOC(dst, n, what) \
    if (!((dst) = kvc_model_alloc_floats(m, (n), (what)))) goto fail
    ALLOC(m->tok_embd, V * D, "token embedding");
    ALLOC(m->out_norm, D, "output norm");
    if (cfg->tied_embeddings) {
        m->lm_head = m->tok_embd;
    } else {
        ALLOC(m->lm_head, V * D, "lm_head");
    }
    ALLOC(m->rope_inv_freq, cfg->head_dim / 2, "rope frequencies");
    for (int l = 0; l < cfg->n_layers; l++) {
        kvc_layer_weights *L = &m->layers[l];
        ALLOC(L->attn_norm, D, "attn_norm");
        ALLOC(L->wq, qd * D, "q_proj");
        ALLOC(L->wk, kd * D, "k_proj");
        ALLOC(L->wv, kd * D, "v_proj");
        ALLOC(L->wo, D * qd, "o_proj");
        if (cfg->qkv_bias) {
            ALLOC(L->bq, qd, "q bias");
            ALLOC(L->bk, kd, "k bias");
            ALLOC(L->bv, kd, "v bias");
        }
        ALLOC(L->ffn_norm, D, "ffn_norm");
        ALLOC(L->w_gate, F * D, "gate_proj");
        ALLOC(L->w_up, F * D, "up_proj");
        ALLOC(L->w_down, D * F, "down_proj");
    }
#undef ALLOC
    *out = m;
    return KVC_OK;
fail:
    kvc_model_free(m);
    return KVC_ERR_NOMEM;
}

kvc_status kvc_kernel_rope_freqs(const kvc_config *c, float *inv_freq) {
    if (!c || !inv_freq) return kvc_fail(KVC_ERR_ARG, "rope_freqs: null argument");
    if (c->head_dim <= 0 || c->head_dim % 2) return kvc_fail(KVC_ERR_ARG, "rope_freqs: head_dim must be even and positive");
    const int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = pow((double)c->rope_theta, -(2.0 * i) / c->head_dim);
        if (c->rope_scaling_factor > 0) {
            /* Llama-3.1: long wavelengths are divided by `factor`, short ones kept, smooth between. */
            const double lo_wl = c->rope_original_context / c->rope_low_freq_factor;
            const double hi_wl = c->rope_original_context / c->rope_high_freq_factor;
            const double wl = 2.0 * M_PI / f;
            if (wl > lo_wl) {
                f = f / c->rope_scaling_factor;
            } else if (wl >= hi_wl) {
                double smooth = (c->rope_original_context / wl - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1 - smooth) * f / c->rope_scaling_factor + smooth * f;
            }
        }
        inv_freq[i] = (float)f;
    }
    return KVC_OK;
}

kvc_status kvc_model_finish(kvc_model *m) {
    KVC_TRY(kvc_kernel_rope_freqs(&m->cfg, m->rope_inv_freq));
    if (m->rope_factors) {
        /* GGUF stores Llama-3.1 scaling as per-frequency divisors */
        for (int i = 0; i < m->cfg.head_dim / 2; i++) {
            if (!(m->rope_factors[i] > 0) || !isfinite(m->rope_factors[i]))
                return kvc_fail(KVC_ERR_FORMAT, "rope_freqs.weight has a non-positive factor at %d", i);
            m->rope_inv_freq[i] /= m->rope_factors[i];
        }
    }
    return KVC_OK;
}

void kvc_model_free(kvc_model *m) {
    if (!m) return;
    kvc_cuda_model_release(m);
    for (size_t i = 0; i < m->n_owned; i++) kvc_free(m->owned[i]);
    free(m->owned);
    if (m->meta) gguf_close(m->meta);
    free(m);
}

kvc_status kvc_model_load(const char *path, kvc_model **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_model_load: out is NULL");
    *out = NULL;
    if (!path || !*path) return kvc_fail(KVC_ERR_ARG, "model path is empty");
    struct stat st;
    if (stat(path, &st) != 0)
        return kvc_fail(KVC_ERR_IO, "model path '%s' does not exist: give a .gguf file or a Hugging Face folder", path);
    if (S_ISDIR(st.st_mode)) return kvc_load_hf(path, out);
    return kvc_load_gguf(path, out);
}

kvc_status kvc_model_get_config(const kvc_model *m, kvc_config *out) {
    if (!m || !out) return kvc_fail(KVC_ERR_ARG, "kvc_model_get_config: null argument");
    *out = m->cfg;
    return KVC_OK;
}

size_t kvc_model_weight_bytes(const kvc_model *m) { return m ? m->weight_bytes : 0; }
const char *kvc_model_format(const kvc_model *m) { return m ? m->format : ""; }

int64_t kvc_model_meta_count(const kvc_model *m) { return (m && m->meta) ? gguf_n_kv(m->meta) : 0; }

static kvc_status meta_index(const kvc_model *m, int64_t i) {
    if (!m) return kvc_fail(KVC_ERR_ARG, "model is NULL");
    if (i < 0 || i >= kvc_model_meta_count(m)) return kvc_fail(KVC_ERR_ARG, "metadata index %lld out of range", (long long)i);
    return KVC_OK;
}

kvc_status kvc_model_meta_info(const kvc_model *m, int64_t i, const char **key, int32_t *type,
                               int32_t *is_array, uint64_t *n) {
    KVC_TRY(meta_index(m, i));
    *key = gguf_kv_key(m->meta, i);
    *type = gguf_kv_type(m->meta, i, is_array, n);
    return KVC_OK;
}

kvc_status kvc_model_meta_number(const kvc_model *m, int64_t i, uint64_t j, double *out) {
    KVC_TRY(meta_index(m, i));
    return gguf_kv_number(m->meta, i, j, out);
}

kvc_status kvc_model_meta_string(const kvc_model *m, int64_t i, uint64_t j, const char **s, uint64_t *len) {
    KVC_TRY(meta_index(m, i));
    return gguf_kv_string(m->meta, i, j, s, len);
}
