/* Build a kvc_model from a GGUF file: config from the `{arch}.*` metadata, tensors by llama.cpp's
 * names, every shape checked against the config, each tensor streamed to the backend (kvc_model_put). ggml shapes list the
 * contiguous (input) dimension first: a [out, in] matrix has ne = [in, out]. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dequant.h"
#include "gguf.h"
#include "model.h"

#define HINT "; the file may be truncated or corrupt: re-download or re-convert it"
#define ARCHS "llama (Mixtral too), mistral, qwen2, qwen3, qwen3moe, phi3, gemma2 and gemma3"

static kvc_status arch_of(const gguf_file *f, char *arch, size_t cap, int32_t *code) {
    const char *s = NULL;
    uint64_t len = 0;
    KVC_TRY(gguf_get_string_opt(f, "general.architecture", &s, &len));
    if (!s) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata general.architecture is missing" HINT);
    if (len >= cap || memchr(s, 0, len))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF architecture '%.*s' is not supported (" ARCHS " are)",
                        (int)(len < 64 ? len : 64), s);
    memcpy(arch, s, len);
    arch[len] = '\0';
    if (!strcmp(arch, "llama")) *code = KVC_ARCH_LLAMA; /* also Mistral and SmolLM conversions */
    else if (!strcmp(arch, "mistral")) *code = KVC_ARCH_MISTRAL;
    else if (!strcmp(arch, "qwen2")) *code = KVC_ARCH_QWEN2;
    else if (!strcmp(arch, "qwen3")) *code = KVC_ARCH_QWEN3;
    else if (!strcmp(arch, "phi3")) *code = KVC_ARCH_PHI3;
    else if (!strcmp(arch, "gemma3")) *code = KVC_ARCH_GEMMA3;
    else if (!strcmp(arch, "gemma2")) *code = KVC_ARCH_GEMMA2;
    else if (!strcmp(arch, "qwen3moe")) *code = KVC_ARCH_QWEN3_MOE;
    else return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF architecture '%s' is not supported (" ARCHS " are)", arch);
    return KVC_OK;
}

static void arch_key(char *key, size_t cap, const char *arch, const char *suffix) {
    snprintf(key, cap, "%s.%s", arch, suffix);
}

/* `{arch}.{suffix}` as an int32: required, or `def` when absent. */
static kvc_status arch_int(const gguf_file *f, const char *arch, const char *suffix, int64_t def, int required, int32_t *out) {
    char key[128];
    arch_key(key, sizeof key, arch, suffix);
    int64_t v = def;
    KVC_TRY(required ? gguf_get_int(f, key, &v) : gguf_get_int_opt(f, key, &v));
    if (v < INT32_MIN || v > INT32_MAX) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata %s = %lld is out of range" HINT, key, (long long)v);
    *out = (int32_t)v;
    return KVC_OK;
}

static kvc_status arch_float(const gguf_file *f, const char *arch, const char *suffix, float *inout) {
    char key[128];
    arch_key(key, sizeof key, arch, suffix);
    double x = *inout;
    KVC_TRY(gguf_get_float_opt(f, key, &x));
    if (!isfinite(x)) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata %s = %g is not finite" HINT, key, x);
    *inout = (float)x;
    return KVC_OK;
}

/* Linear RoPE scaling (positions / factor, i.e. every frequency / factor), as a per-frequency
 * divisor; 1 when there is none. Other scalings change more than the frequencies: refused. */
static kvc_status rope_scaling(const gguf_file *f, const char *arch, float *linear) {
    char key[128];
    const char *type = NULL;
    uint64_t len = 0;
    float factor = 0.0f, legacy = 0.0f;
    *linear = 1.0f;
    arch_key(key, sizeof key, arch, "rope.scaling.type");
    KVC_TRY(gguf_get_string_opt(f, key, &type, &len));
    KVC_TRY(arch_float(f, arch, "rope.scaling.factor", &factor));
    KVC_TRY(arch_float(f, arch, "rope.scale_linear", &legacy));
    if (legacy != 0.0f && legacy != 1.0f) {
        if (!(legacy > 0)) return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s.rope.scale_linear = %g" HINT, arch, legacy);
        *linear = legacy;
    }
    const int none = !type || (len == 4 && !memcmp(type, "none", 4));
    if (none || factor == 0.0f || factor == 1.0f) return KVC_OK;
    if (len == 6 && !memcmp(type, "linear", 6)) {
        if (!(factor > 0)) return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s.rope.scaling.factor = %g" HINT, arch, factor);
        *linear = factor;
        return KVC_OK;
    }
    return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: RoPE scaling '%.*s' (factor %g) is not supported (linear and Llama-3.1 rope_freqs are)",
                    (int)(len < 32 ? len : 32), type, factor);
}

/* LongRoPE (llama.cpp's phi3: rope_factors_short/long.weight): the original context and the attention
 * factor from the metadata (the factor, when absent, as transformers defaults it: sqrt(1 + ln s / ln
 * original), s = context_length / original, 1 when s <= 1). The long factors apply as transformers applies
 * them (a call past the original context), not by llama.cpp's rule (a context window larger than it). */
static kvc_status longrope(const gguf_file *f, const char *arch, kvc_config *c) {
    const int has_long = gguf_find_tensor(f, "rope_factors_long.weight") != NULL;
    if (!has_long && !gguf_find_tensor(f, "rope_factors_short.weight")) return KVC_OK;
    if (c->arch != KVC_ARCH_PHI3)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: LongRoPE factors (rope_factors_long/short.weight) in a '%s' model are not supported (phi3's are)", arch);
    if (!has_long || !gguf_find_tensor(f, "rope_factors_short.weight"))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight" HINT);
    int32_t orig = 0;
    KVC_TRY(arch_int(f, arch, "rope.scaling.original_context_length", 0, 1, &orig));
    if (orig < 1) return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s.rope.scaling.original_context_length = %d" HINT, arch, orig);
    const double s = (double)c->max_context / orig;
    float attn = s <= 1.0 ? 1.0f : (float)sqrt(1.0 + log(s) / log((double)orig));
    KVC_TRY(arch_float(f, arch, "rope.scaling.attn_factor", &attn));
    if (!(attn > 0)) return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s.rope.scaling.attn_factor = %g" HINT, arch, attn);
    c->rope_long_context = orig;
    c->rope_attn_factor = attn;
    return KVC_OK;
}

/* Gemma 2 and 3 as llama.cpp runs its 'gemma2' and 'gemma3' files: with a sliding window, every other layer
 * (gemma2) or every layer but each 6th (gemma3) slides, gemma3's on RoPE base rope.freq_base_swa (10000 when
 * absent, unscaled); norms stored as 1 + w (its converter adds the 1); attention scale 1/sqrt(key_length), or
 * 1/sqrt(hidden / heads) for the 27B models (46 layers gemma2, 62 gemma3: Gemma's query_pre_attn_scalar);
 * embeddings times sqrt(hidden); soft-capping (attn_logit_softcapping, final_logit_softcapping) where the file
 * sets it; gemma3's q/k norms. */
static kvc_status read_gemma(const gguf_file *f, const char *arch, kvc_config *c) {
    const int g2 = c->arch == KVC_ARCH_GEMMA2;
    KVC_TRY(arch_float(f, arch, "final_logit_softcapping", &c->logit_softcap));
    if (g2) KVC_TRY(arch_float(f, arch, "attn_logit_softcapping", &c->attn_softcap));
    if (c->logit_softcap < 0 || c->attn_softcap < 0)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s soft-capping is negative (%g, %g)" HINT, arch, c->attn_softcap, c->logit_softcap);
    if (c->sliding_window > 0) {
        c->window_period = g2 ? 2 : 6;
        if (!g2) {
            c->rope_local_theta = 10000.0f;
            KVC_TRY(arch_float(f, arch, "rope.freq_base_swa", &c->rope_local_theta));
        }
    }
    const int big = c->n_layers == (g2 ? 46 : 62);
    c->attn_scale = 1.0f / sqrtf(big ? (float)(c->hidden / c->n_heads) : (float)c->head_dim);
    c->embed_scale = sqrtf((float)c->hidden);
    c->qk_norm = !g2;
    c->post_norms = 1;
    c->mlp_act = KVC_MLP_GELU_TANH;
    return KVC_OK;
}

/* Mixture of experts as llama.cpp runs its 'qwen3moe' and 'llama' (Mixtral) files: expert_count experts of
 * expert_feed_forward_length (else feed_forward_length), expert_used_count per token, softmax gating with the chosen
 * weights renormalised (expert_weights_norm, which llama.cpp's converter writes for neither: true for both). A layer
 * with a router (blk.N.ffn_gate_inp.weight) is an MoE layer, one without a dense MLP. Shared experts, other gating
 * functions and scaled expert weights are refused. Called once the layer count is read. */
static kvc_status read_moe(const gguf_file *f, const char *arch, kvc_config *c, int32_t experts) {
    if (c->arch != KVC_ARCH_LLAMA && c->arch != KVC_ARCH_QWEN3_MOE)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: mixture-of-experts '%s' models (%s.expert_count = %d) are not supported "
                        "(qwen3moe and llama's Mixtral are)", arch, arch, experts);
    if (c->arch == KVC_ARCH_LLAMA) c->arch = KVC_ARCH_MIXTRAL; /* llama.cpp's converter writes Mixtral as 'llama' */
    int32_t shared = 0, gating = 1;
    KVC_TRY(arch_int(f, arch, "expert_shared_count", 0, 0, &shared));
    KVC_TRY(arch_int(f, arch, "expert_gating_func", 1, 0, &gating));
    float scale = 0.0f;
    KVC_TRY(arch_float(f, arch, "expert_weights_scale", &scale));
    if (shared > 0) return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: shared experts (%s.expert_shared_count = %d) are not supported", arch, shared);
    if (gating != 1)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: expert gating function %d is not supported (1, softmax, is)", gating);
    if (scale != 0.0f && scale != 1.0f)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: scaled expert weights (%s.expert_weights_scale = %g) are not supported", arch, scale);
    c->n_experts = experts;
    KVC_TRY(arch_int(f, arch, "expert_used_count", 0, 1, &c->n_experts_used));
    KVC_TRY(arch_int(f, arch, "expert_feed_forward_length", c->ffn, 0, &c->moe_ffn));
    char key[128];
    arch_key(key, sizeof key, arch, "expert_weights_norm");
    int64_t norm = 1;
    KVC_TRY(gguf_get_int_opt(f, key, &norm));
    c->moe_norm_topk = norm != 0;
    c->moe_step = 1;
    for (int32_t l = 0; l < c->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", (int)l);
        if (gguf_find_tensor(f, name)) continue;
        if (l >= KVC_MOE_DENSE_LAYERS)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: layer %d has no router; dense layers past layer %d of an MoE model are "
                            "not supported", l, KVC_MOE_DENSE_LAYERS - 1);
        c->moe_dense[l / 32] |= 1u << (l % 32);
    }
    return KVC_OK;
}

static kvc_status read_config(const gguf_file *f, kvc_config *c, float *linear_scale) {
    char arch[32];
    kvc_config_defaults(c);
    KVC_TRY(arch_of(f, arch, sizeof arch, &c->arch));
    KVC_TRY(arch_int(f, arch, "block_count", 0, 1, &c->n_layers));
    KVC_TRY(arch_int(f, arch, "embedding_length", 0, 1, &c->hidden));
    KVC_TRY(arch_int(f, arch, "attention.head_count", 0, 1, &c->n_heads));
    KVC_TRY(arch_int(f, arch, "attention.head_count_kv", c->n_heads, 0, &c->n_kv_heads));
    KVC_TRY(arch_int(f, arch, "feed_forward_length", 0, 1, &c->ffn));
    KVC_TRY(arch_int(f, arch, "context_length", 0, 0, &c->max_context));
    int32_t experts = 0;
    KVC_TRY(arch_int(f, arch, "expert_count", 0, 0, &experts));
    if (experts > 0 && c->n_layers > 0 && c->n_layers <= 4096) KVC_TRY(read_moe(f, arch, c, experts));
    if (c->n_heads <= 0 || c->hidden <= 0)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s.attention.head_count = %d, %s.embedding_length = %d (must be positive)" HINT, arch,
                        c->n_heads, arch, c->hidden);
    /* head_dim: key_length, else the rotary dimension count, else hidden / heads (phi3, whose rotary
     * dimensions may be fewer: key_length, else hidden / heads, as llama.cpp reads it) */
    int32_t rot = c->hidden / c->n_heads;
    KVC_TRY(arch_int(f, arch, "rope.dimension_count", rot, 0, &rot));
    KVC_TRY(arch_int(f, arch, "attention.key_length", c->arch == KVC_ARCH_PHI3 ? c->hidden / c->n_heads : rot, 0, &c->head_dim));
    int32_t vlen = c->head_dim;
    KVC_TRY(arch_int(f, arch, "attention.value_length", c->head_dim, 0, &vlen));
    if (vlen != c->head_dim)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: key length %d != value length %d is not supported", c->head_dim, vlen);
    /* llama.cpp's converter permutes llama/mistral q/k rows to adjacent pairs; qwen2/qwen3/phi3 stay "neox" */
    c->rope_pairing = c->arch == KVC_ARCH_LLAMA || c->arch == KVC_ARCH_MISTRAL || c->arch == KVC_ARCH_MIXTRAL ? KVC_ROPE_ADJACENT
                                                                                                           : KVC_ROPE_HALF;
    if (rot != c->head_dim && (c->rope_pairing != KVC_ROPE_HALF || rot < 2 || rot > c->head_dim || rot % 2))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: partial rotary embeddings (%s.rope.dimension_count %d of head_dim %d) are "
                        "supported in architectures with (i, i + d/2) pairs (qwen2, qwen3, phi3) and an even count", arch, rot, c->head_dim);
    if (rot != c->head_dim) c->rope_dim = rot;
    KVC_TRY(arch_float(f, arch, "rope.freq_base", &c->rope_theta));
    KVC_TRY(arch_float(f, arch, "attention.layer_norm_rms_epsilon", &c->rms_eps));
    KVC_TRY(rope_scaling(f, arch, linear_scale));
    KVC_TRY(longrope(f, arch, c));
    /* vocabulary: metadata, else the tokenizer's list, else the embedding's rows */
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb) return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor 'token_embd.weight' is missing" HINT);
    int64_t vocab = emb->n_dims == 2 ? emb->ne[1] : 0;
    int64_t ti = gguf_find_kv(f, "tokenizer.ggml.tokens");
    if (ti >= 0) {
        int32_t is_array;
        uint64_t n;
        gguf_kv_type(f, ti, &is_array, &n);
        if (is_array && n > 0 && n <= INT32_MAX) vocab = (int64_t)n;
    }
    KVC_TRY(arch_int(f, arch, "vocab_size", vocab, 0, &c->vocab));
    c->tied_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    c->qkv_bias = gguf_find_tensor(f, "blk.0.attn_q.bias") != NULL;
    c->qk_norm = c->arch == KVC_ARCH_QWEN3 || c->arch == KVC_ARCH_QWEN3_MOE;
    /* a window the file states applies to every layer (llama.cpp's key; its converters write it for mistral;
     * gemma2 and gemma3: read_gemma interleaves) */
    KVC_TRY(arch_int(f, arch, "attention.sliding_window", 0, 0, &c->sliding_window));
    if (c->arch == KVC_ARCH_GEMMA2 || c->arch == KVC_ARCH_GEMMA3) KVC_TRY(read_gemma(f, arch, c));
    int64_t v = -1;
    KVC_TRY(gguf_get_int_opt(f, "tokenizer.ggml.bos_token_id", &v));
    c->bos_id = (v >= -1 && v <= INT32_MAX) ? (int32_t)v : -1;
    v = -1;
    KVC_TRY(gguf_get_int_opt(f, "tokenizer.ggml.eos_token_id", &v));
    c->eos_id = (v >= -1 && v <= INT32_MAX) ? (int32_t)v : -1;
    return KVC_OK;
}

/* Tensors a llama/qwen2 block may carry that this model has no place for: refusing them beats
 * silently computing something else. */
static kvc_status refuse_extra_tensors(const gguf_file *f, const kvc_config *c) {
    static const char *extra[] = {"attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", "ffn_gate_inp.weight",
                                  "attn_qkv.weight", "ffn_gate.weight", "attn_q_norm.weight", "attn_k_norm.weight"};
    const size_t n_extra = sizeof extra / sizeof extra[0];
    char name[64];
    for (size_t i = 0; i < n_extra; i++) {
        if (c->qk_norm && strstr(extra[i], "_norm.weight")) continue;                               /* qwen3's q/k norms */
        if (c->n_experts > 0 && !strcmp(extra[i], "ffn_gate_inp.weight")) continue;                 /* an MoE router */
        const int qkv = !strcmp(extra[i], "attn_qkv.weight"), gate = !strcmp(extra[i], "ffn_gate.weight");
        if ((qkv && kvc_fused_proj(c)) || (gate && !kvc_fused_proj(c))) continue; /* fused (phi3) or separate: what it reads */
        snprintf(name, sizeof name, "blk.0.%s", extra[i]);
        if (gguf_find_tensor(f, name))
            return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: tensor '%s' is not supported by this model architecture in kvpress_c", name);
    }
    /* an MoE layer's shared expert and gating bias (other MoE families) */
    static const char *moe_extra[] = {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                                      "ffn_gate_inp_shexp.weight", "exp_probs_b.bias"};
    for (int32_t l = 0; c->n_experts > 0 && l < c->n_layers; l++)
        for (size_t i = 0; i < sizeof moe_extra / sizeof moe_extra[0]; i++) {
            snprintf(name, sizeof name, "blk.%d.%s", (int)l, moe_extra[i]);
            if (gguf_find_tensor(f, name))
                return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: tensor '%s' (shared experts, gating bias) is not supported in kvpress_c", name);
        }
    return KVC_OK;
}

static void shape_str(const gguf_tensor *t, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "[");
    for (int k = 0; k < t->n_dims && n > 0 && (size_t)n < cap; k++)
        n += snprintf(buf + n, cap - (size_t)n, "%s%lld", k ? ", " : "", (long long)t->ne[k]);
    if (n > 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, "]");
}

static kvc_status decode_rows(const kvc_src *s, int64_t r0, int64_t nr, float *dst) {
    kvc_status st = ggml_dequantize(s->type, (const char *)s->data + (size_t)r0 * s->row_bytes, (size_t)nr * s->row_bytes,
                                    dst, nr * s->cols);
    if (st != KVC_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvc_last_error());
        return kvc_fail(st, "GGUF: tensor '%s': %s", s->name, msg);
    }
    return KVC_OK;
}

/* Check tensor `name` against the logical shape [rows, cols] (ggml ne = [cols, rows]; a vector when
 * rows == 0; with x, a 3-D stack ne = [cols, rows, x->n] of which expert x->e's matrix) and its type, and
 * describe it as a source of rows. */
static kvc_status source(const gguf_file *f, const char *name, int64_t rows, int64_t cols, const kvc_expert *x, kvc_src *out) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' is missing; the file may be corrupt, or from another architecture", name);
    const int ok = x ? t->n_dims == 3 && t->ne[0] == cols && t->ne[1] == rows && t->ne[2] == x->n
                 : rows == 0 ? (t->n_dims == 1 && t->ne[0] == cols) : (t->n_dims == 2 && t->ne[0] == cols && t->ne[1] == rows);
    if (!ok) {
        char found[96];
        shape_str(t, found, sizeof found);
        if (x)
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has shape %s, expected [%lld, %lld, %d] (ggml order: input dim "
                            "first, then the experts) for this config" HINT, name, found, (long long)cols, (long long)rows, x->n);
        if (rows == 0)
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has shape %s, expected [%lld] (ggml order) for this config" HINT, name,
                            found, (long long)cols);
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has shape %s, expected [%lld, %lld] (ggml order: input dim first) for this config" HINT,
                        name, found, (long long)cols, (long long)rows);
    }
    if (!ggml_type_supported(t->type) || !t->data) {
        if (ggml_type_known(t->type))
            return kvc_fail(KVC_ERR_UNSUPPORTED,
                            "GGUF: tensor '%s' is %s, which kvpress_c cannot decode (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                            "Q2_K..Q6_K): use a file with one of those types", name, ggml_type_name(t->type));
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: tensor '%s' has ggml type id %d, unknown to this version of kvpress_c", name, t->type);
    }
    const int64_t r = rows == 0 ? 1 : rows, n = x ? x->n : 1;
    size_t row_bytes = 0;
    kvc_status st = ggml_nbytes(t->type, cols, &row_bytes); /* rows are whole blocks (cols a multiple of the block) */
    if (st != KVC_OK || row_bytes * (size_t)r * (size_t)n != t->nbytes)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' (%s) does not split into %lld rows of %lld values" HINT, name,
                        ggml_type_name(t->type), (long long)(r * n), (long long)cols);
    memset(out, 0, sizeof *out);
    out->name = t->name;
    out->rows = r;
    out->cols = cols;
    out->decode = decode_rows;
    out->data = (const char *)t->data + (x ? (size_t)x->e * (size_t)r * row_bytes : 0);
    out->row_bytes = row_bytes;
    out->type = t->type;
    out->ggml_type = t->type;
    return KVC_OK;
}

static kvc_status put(const void *file, kvc_model *m, kvc_weight_role role, int32_t layer, const char *name, int64_t rows,
                      int64_t cols, const kvc_expert *x) {
    kvc_src src;
    KVC_TRY(source(file, name, rows, cols, x, &src));
    return kvc_model_put(m, role, layer, x ? x->e : -1, &src);
}

static kvc_status load_weights(const gguf_file *f, kvc_model *m, float linear_scale) {
    const kvc_config *c = &m->cfg;
    const int64_t D = c->hidden;
    KVC_TRY(refuse_extra_tensors(f, c));
    KVC_TRY(put(f, m, KVC_W_TOK, 0, "token_embd.weight", c->vocab, D, NULL));
    KVC_TRY(put(f, m, KVC_W_OUT_NORM, 0, "output_norm.weight", 0, D, NULL));
    if (!c->tied_embeddings) KVC_TRY(put(f, m, KVC_W_LM_HEAD, 0, "output.weight", c->vocab, D, NULL));
    KVC_TRY(kvc_model_put_layers(m, 0, put, f));
    const int32_t half = c->head_dim / 2;
    if (c->rope_long_context > 0) { /* LongRoPE's factors, one per turned pair */
        float *sf = kvc_model_rope_factors(m), *lf = kvc_model_rope_long_factors(m);
        if (!sf || !lf) return KVC_ERR_NOMEM;
        const int32_t n = (c->rope_dim > 0 ? c->rope_dim : c->head_dim) / 2;
        kvc_src src;
        KVC_TRY(source(f, "rope_factors_short.weight", 0, n, NULL, &src));
        KVC_TRY(src.decode(&src, 0, 1, sf));
        KVC_TRY(source(f, "rope_factors_long.weight", 0, n, NULL, &src));
        KVC_TRY(src.decode(&src, 0, 1, lf));
        if (gguf_find_tensor(f, "rope_freqs.weight") || linear_scale != 1.0f)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: LongRoPE with rope_freqs.weight or linear scaling is not supported");
        return KVC_OK;
    }
    const int has_freqs = gguf_find_tensor(f, "rope_freqs.weight") != NULL;
    if (has_freqs || linear_scale != 1.0f) {
        /* per-frequency divisors, applied by kvc_model_finish: Llama-3.1's rope_freqs, times a
         * linear scaling factor */
        float *factors = kvc_model_rope_factors(m);
        if (!factors) return KVC_ERR_NOMEM;
        if (has_freqs) {
            kvc_src src;
            KVC_TRY(source(f, "rope_freqs.weight", 0, half, NULL, &src));
            KVC_TRY(src.decode(&src, 0, 1, factors));
        } else {
            for (int32_t i = 0; i < half; i++) factors[i] = 1.0f;
        }
        for (int32_t i = 0; i < half; i++) factors[i] *= linear_scale;
    }
    return KVC_OK;
}

static kvc_status describe(const void *file, const char *name, int64_t rows, int64_t cols, const kvc_expert *x, kvc_src *out) {
    return source(file, name, rows, cols, x, out);
}

kvc_status kvc_load_gguf(const char *path, const kvc_backend *be, int32_t weights, kvc_model **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_load_gguf: out is NULL");
    *out = NULL;
    gguf_file *f = NULL;
    KVC_TRY(gguf_open(path, &f));
    kvc_config cfg;
    kvc_model *m = NULL;
    float linear_scale = 1.0f;
    kvc_status st = read_config(f, &cfg, &linear_scale);
    if (st == KVC_OK) st = kvc_model_create(&cfg, "gguf", path, be, weights, 0, describe, f, &m);
    if (st != KVC_OK) {
        kvc_model_free(m);
        gguf_close(f);
        return st;
    }
    /* from here the model owns the file: its metadata (the tokenizer's) and its mapping, which weights
     * used in place point into; kvc_model_free unmaps it once, after the buffers, on every path */
    m->meta = f;
    st = load_weights(f, m, linear_scale);
    if (st == KVC_OK) st = kvc_model_finish(m);
    if (st != KVC_OK) {
        kvc_model_free(m);
        return st;
    }
    *out = m;
    return KVC_OK;
}
