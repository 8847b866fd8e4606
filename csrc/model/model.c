/* kvc_model: the config check, the weight buffers on the backend, streaming tensors into them, RoPE
 * frequencies, host fp32 weights on demand, format dispatch. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dequant.h"
#include "gguf.h"
#include "model.h"

#define CHUNK_FLOATS (1 << 22) /* rows decoded per upload: 16 MB of fp32 at most (one row if longer) */

void kvc_config_defaults(kvc_config *c) {
    memset(c, 0, sizeof *c);
    c->arch = KVC_ARCH_LLAMA;
    c->rope_pairing = KVC_ROPE_HALF;
    c->rms_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->bos_id = -1;
    c->eos_id = -1;
}

static kvc_status check_config(const kvc_config *c) {
#define REQUIRE(cond, ...) \
    if (!(cond)) return kvc_fail(KVC_ERR_FORMAT, "invalid model config: " __VA_ARGS__)
    REQUIRE(c->arch >= KVC_ARCH_LLAMA && c->arch <= KVC_ARCH_MIXTRAL, "unknown architecture %d", c->arch);
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
    REQUIRE(c->sliding_window >= 0, "sliding_window = %d", c->sliding_window);
    REQUIRE(c->window_first_layer >= 0 && c->window_first_layer <= c->n_layers, "the first sliding-window layer is %d of %d",
            c->window_first_layer, c->n_layers);
    REQUIRE(c->rope_dim == 0 || (c->rope_dim >= 2 && c->rope_dim <= c->head_dim && c->rope_dim % 2 == 0),
            "rotary dimensions = %d (even, in [2, head_dim = %d])", c->rope_dim, c->head_dim);
    REQUIRE(c->rope_dim == 0 || c->rope_dim == c->head_dim || c->rope_pairing == KVC_ROPE_HALF,
            "a partial rotary embedding needs the (i, i + d/2) pairing");
    REQUIRE(c->rope_long_context >= 0, "LongRoPE original context = %d", c->rope_long_context);
    REQUIRE(c->rope_long_context == 0 || c->rope_scaling_factor == 0, "LongRoPE and llama3 RoPE scaling together");
    REQUIRE(isfinite(c->rope_attn_factor) && c->rope_attn_factor >= 0, "RoPE attention factor = %g", c->rope_attn_factor);
    REQUIRE(c->window_period >= 0, "window period = %d", c->window_period);
    REQUIRE(isfinite(c->rope_local_theta) && (c->rope_local_theta == 0 || c->rope_local_theta > 1), "local rope_theta = %g",
            c->rope_local_theta);
    REQUIRE(c->rope_local_theta == 0 || c->rope_long_context == 0, "LongRoPE with a separate sliding-layer RoPE base");
    REQUIRE(isfinite(c->attn_scale) && c->attn_scale >= 0, "attention scale = %g", c->attn_scale);
    REQUIRE(isfinite(c->embed_scale) && c->embed_scale >= 0, "embedding scale = %g", c->embed_scale);
    REQUIRE(c->mlp_act == KVC_MLP_SILU || c->mlp_act == KVC_MLP_GELU_TANH, "MLP activation %d", c->mlp_act);
    REQUIRE(c->post_norms == 0 || c->post_norms == 1, "post_norms = %d", c->post_norms);
    REQUIRE(isfinite(c->attn_softcap) && c->attn_softcap >= 0, "attention soft-capping = %g", c->attn_softcap);
    REQUIRE(isfinite(c->logit_softcap) && c->logit_softcap >= 0, "final logit soft-capping = %g", c->logit_softcap);
    REQUIRE(c->n_experts >= 0 && c->n_experts <= 4096, "n_experts = %d", c->n_experts);
    if (c->n_experts > 0) {
        REQUIRE(c->n_experts_used >= 1 && c->n_experts_used <= c->n_experts, "experts per token = %d (of %d)",
                c->n_experts_used, c->n_experts);
        REQUIRE(c->moe_ffn > 0 && c->moe_ffn <= 1 << 20, "expert intermediate size = %d", c->moe_ffn);
        REQUIRE(c->moe_norm_topk == 0 || c->moe_norm_topk == 1, "moe_norm_topk = %d", c->moe_norm_topk);
        REQUIRE(c->moe_step >= 1, "MoE layer step = %d", c->moe_step);
        REQUIRE(c->mlp_act == KVC_MLP_SILU && !c->post_norms, "experts are SwiGLU MLPs without output norms");
    }
    for (int32_t l = c->n_layers; l < KVC_MOE_DENSE_LAYERS; l++)
        REQUIRE(!(c->moe_dense[l / 32] >> (l % 32) & 1u), "dense-MLP layer %d of %d", l, c->n_layers);
#undef REQUIRE
    /* the one limit the kernels' parameter blocks set (KV heads per layer), checked here for every device */
    if (c->n_kv_heads > KVC_MAX_KV_HEADS)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "models with more than %d KV heads are not supported (this one has %d)",
                        KVC_MAX_KV_HEADS, c->n_kv_heads);
    return KVC_OK;
}

/* Bytes of n elements of dtype (native weight types: whole blocks), or (size_t)-1 when n is not. */
static size_t dtype_bytes(int32_t dtype, int64_t n) {
    size_t bytes = (size_t)n * kvc_dtype_size(dtype);
    if (kvc_dtype_is_wtype(dtype) && ggml_nbytes(dtype - KVC_WTYPE_BASE, n, &bytes) != KVC_OK) return (size_t)-1;
    return bytes;
}

/* A weight buffer of the backend, owned by the model: allocated, or with `mapped` a read-only buffer over
 * the file's bytes there (the file stays mapped as long as the model). *view covers it from element 0 with
 * row length ld. */
static kvc_status own(kvc_model *m, int32_t dtype, int64_t n, int64_t ld, const void *mapped, const char *what,
                      kvc_view *view) {
    if (m->n_bufs == m->cap_bufs) {
        const size_t cap = m->cap_bufs ? 2 * m->cap_bufs : 64;
        kvc_model_buf *p = realloc(m->bufs, cap * sizeof *p);
        if (!p) return kvc_fail(KVC_ERR_NOMEM, "out of memory: model buffer list");
        m->bufs = p;
        m->cap_bufs = cap;
    }
    const size_t bytes = dtype_bytes(dtype, n);
    if (bytes == (size_t)-1) return kvc_fail(KVC_ERR_INTERNAL, "%s: %lld values are not whole blocks", what, (long long)n);
    kvc_buf *b = NULL;
    KVC_TRY(mapped ? m->be->wrap(dtype, n, mapped, what, &b) : m->be->alloc(dtype, n, KVC_MEM_WEIGHTS, what, &b));
    m->bufs[m->n_bufs++] = (kvc_model_buf){b, dtype, mapped};
    m->weight_bytes += bytes;
    if (mapped) m->mapped_bytes += bytes;
    *view = kvc_view_of(b, 0, ld);
    return KVC_OK;
}

static const char *role_name(const kvc_config *c, kvc_weight_role role, int hf);

int kvc_layer_slides(const kvc_config *c, int32_t l) {
    return c->sliding_window > 0 && l >= c->window_first_layer && !(c->window_period > 0 && (l + 1) % c->window_period == 0);
}

int kvc_layer_pressed(const kvc_config *c, int32_t l) { return !(c->window_period > 0 && kvc_layer_slides(c, l)); }

kvc_status kvc_require_every_layer_pressed(const kvc_config *c, const char *what) {
    for (int32_t l = 0; l < c->n_layers; l++)
        if (!kvc_layer_pressed(c, l))
            return kvc_fail(KVC_ERR_UNSUPPORTED, "%s selects over every layer's cache at once; on Gemma 2 and 3 presses act on "
                            "the full-attention layers only (as kvpress on Gemma 3) and %s is not defined there yet", what, what);
    return KVC_OK;
}

float kvc_attn_scale(const kvc_config *c) { return c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)c->head_dim); }

int kvc_fused_proj(const kvc_config *c) { return c->arch == KVC_ARCH_PHI3; }

int kvc_layer_moe(const kvc_config *c, int32_t l) {
    if (c->n_experts <= 0 || (l + 1) % c->moe_step) return 0;
    return l >= KVC_MOE_DENSE_LAYERS || !(c->moe_dense[l / 32] >> (l % 32) & 1u);
}

/* Partial rotary: the rows of q and k heads are permuted at load (model.h). */
static int permutes(const kvc_config *c, kvc_weight_role role) {
    return c->rope_dim > 0 && c->rope_dim < c->head_dim && (role == KVC_W_Q || role == KVC_W_K || role == KVC_W_QKV);
}

/* The engine's row of the file's row r of a role's tensor: within each q/k head of d rows, the turned
 * pairs (e, e + rot/2), e < rot/2, go to (e, e + d/2); the passed values rot.. fill the pairs above. */
static int64_t engine_row(const kvc_config *c, kvc_weight_role role, int64_t r) {
    const int64_t d = c->head_dim, qk = (int64_t)(c->n_heads + c->n_kv_heads) * d;
    if (!permutes(c, role) || (role == KVC_W_QKV && r >= qk)) return r; /* v rows keep their order */
    const int64_t e = r % d, r2 = c->rope_dim / 2, half = d / 2, p2 = (d - c->rope_dim) / 2;
    const int64_t to = e < r2 ? e : e < 2 * r2 ? half + (e - r2) : e < 2 * r2 + p2 ? r2 + (e - 2 * r2) : half + r2 + (e - 2 * r2 - p2);
    return r - e + to;
}

/* What kvc_model_create plans the weight matrices with. */
typedef struct plan {
    kvc_model *m;
    int32_t weights;
    int mmap;   /* 0: KVC_WEIGHTS_NO_MMAP */
    int repack; /* 0: KVC_WEIGHTS_NO_REPACK */
    int hf;
    kvc_describe_fn describe;
    const void *file;
} plan;

/* The dtype a weight matrix of the file (s; NULL when the file does not describe it) is held in. */
static int32_t part_dtype(const plan *p, const kvc_src *s) {
    const kvc_backend *be = p->m->be;
    if (p->weights != KVC_WEIGHTS_NATIVE || !s || !be->weight_type_ok) return be->weight_dtype;
    const int32_t t = s->ggml_type;
    if (t < 0 || t == GGML_T_F32 || !be->weight_type_ok(t) || s->cols % ggml_block_elems(t)) return be->weight_dtype;
    return KVC_WTYPE(t);
}

/* Alias or copy: the one place that decides, per tensor. A weight held in `dtype` is used in place in the
 * mapped file when the model keeps native weights, the backend computes on host memory (wrap), its bytes
 * in memory equal the file's (the file's own type, or f32 from f32) and its start is as aligned as the
 * kernels read it (2 bytes for blocks and 16-bit floats, 4 for f32; GGUF aligns data to
 * general.alignment). Everything else is converted or copied into a buffer of the backend: fp32 mode,
 * types the kernels do not take, a device, KVC_WEIGHTS_NO_MMAP, and a dtype the backend rearranges at
 * upload for speed (wrap_keeps_layout: the CPU's interleaved GEMV layout) unless KVC_WEIGHTS_NO_REPACK. */
static int maps(const plan *p, int32_t dtype, const kvc_src *s) {
    if (p->weights != KVC_WEIGHTS_NATIVE || !p->mmap || !p->m->be->wrap || !s || !s->data) return 0;
    const int same = kvc_dtype_is_wtype(dtype) ? s->ggml_type == dtype - KVC_WTYPE_BASE
                                               : dtype == KVC_F32 && s->ggml_type == GGML_T_F32;
    if (p->repack && p->m->be->wrap_keeps_layout && !p->m->be->wrap_keeps_layout(dtype)) return 0;
    return same && (uintptr_t)s->data % (dtype == KVC_F32 ? 4u : 2u) == 0;
}

/* Place a weight group: n roles of one layer (layer -1: a file-level tensor), [rows[i], cols] each, their
 * outputs side by side. One buffer for all when they share a dtype and are all copied, or all mapped and
 * back to back in the file; else one buffer (copied or mapped) per part. */
static kvc_status place(const plan *p, const kvc_weight_role *roles, int n, int32_t layer, const int64_t *rows,
                        int64_t cols, const char *what, kvc_wgroup *g) {
    kvc_model *m = p->m;
    kvc_src src[3];
    int32_t dt[3];
    const void *at[3];
    int same = 1, all_mapped = 1, none_mapped = 1, adjacent = 1;
    int64_t total = 0;
    memset(g, 0, sizeof *g);
    g->n = n;
    for (int i = 0; i < n; i++) {
        char name[160];
        if (layer >= 0)
            snprintf(name, sizeof name, p->hf ? "model.layers.%d.%s" : "blk.%d.%s", (int)layer, role_name(&m->cfg, roles[i], p->hf));
        else
            snprintf(name, sizeof name, "%s", role_name(&m->cfg, roles[i], p->hf));
        /* planning only: a tensor the file lacks or gets wrong is reported when it is loaded */
        const int known = p->weights == KVC_WEIGHTS_NATIVE && p->describe &&
                          p->describe(p->file, name, rows[i], cols, NULL, &src[i]) == KVC_OK;
        dt[i] = part_dtype(p, known ? &src[i] : NULL);
        at[i] = known && !permutes(&m->cfg, roles[i]) && maps(p, dt[i], &src[i]) ? src[i].data : NULL;
        m->n_native += kvc_dtype_is_wtype(dt[i]);
        same &= dt[i] == dt[0];
        all_mapped &= at[i] != NULL;
        none_mapped &= at[i] == NULL;
        if (i > 0) adjacent &= at[i] && at[i - 1] && at[i] == (const char *)at[i - 1] + dtype_bytes(dt[i - 1], rows[i - 1] * cols);
        g->rows[i] = rows[i];
        total += rows[i];
    }
    if (same && (none_mapped || (all_mapped && adjacent))) {
        KVC_TRY(own(m, dt[0], total * cols, cols, at[0], what, &g->whole));
        int64_t r = 0;
        for (int i = 0; i < n; r += rows[i], i++) g->part[i] = kvc_view_at(g->whole, r, 0);
        return KVC_OK;
    }
    for (int i = 0; i < n; i++) KVC_TRY(own(m, dt[i], rows[i] * cols, cols, at[i], what, &g->part[i]));
    return KVC_OK;
}

/* A group the file holds as one tensor (role: KVC_W_QKV, KVC_W_GU): one buffer, its parts row ranges of it. */
static kvc_status place_fused(const plan *p, kvc_weight_role role, int32_t layer, const int64_t *rows, int n, int64_t cols,
                              const char *what, kvc_wgroup *g) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += rows[i];
    KVC_TRY(place(p, &role, 1, layer, &total, cols, what, g));
    g->n = n;
    for (int64_t i = 0, r = 0; i < n; r += rows[i], i++) {
        g->rows[i] = rows[i];
        g->part[i] = kvc_view_at(g->whole, r, 0);
    }
    return KVC_OK;
}

/* One matrix (a group of one). */
static kvc_status place1(const plan *p, kvc_weight_role role, int32_t layer, int64_t rows, int64_t cols, const char *what,
                         kvc_view *v) {
    kvc_wgroup g;
    KVC_TRY(place(p, &role, 1, layer, &rows, cols, what, &g));
    *v = g.whole;
    return KVC_OK;
}

/* ---- an MoE layer's experts ----
 * Each expert role (gate, up, down) is a stack of E matrices of [rows, cols]. A stack is one buffer with a view per
 * expert: used in place when the file holds the stack as one tensor the backend can wrap (GGUF's 3-D tensors;
 * Hugging Face files keep each expert apart, so theirs are copied), else copied. A copied stack of a dtype the
 * backend rearranges at upload (wrap_keeps_layout 0: the CPU's interleaved GEMV layout, whose matrices the matmul
 * takes whole) is one buffer per expert instead. Gate and up share one buffer, each expert's gate rows then its up
 * rows (one GEMM per expert, as the dense gate|up), when they are copied and of one dtype. */

static const kvc_layer_tensor *layer_tensor(kvc_weight_role role);

/* The dtype a stack is held in and, when it is used in place, the file's bytes of its first expert. */
static void plan_stack(const plan *p, kvc_weight_role role, int32_t l, int64_t rows, int64_t cols, int32_t *dt,
                       const void **at) {
    kvc_model *m = p->m;
    const kvc_expert x0 = {0, m->cfg.n_experts};
    char name[200];
    kvc_src s;
    kvc_layer_tensor_path(&m->cfg, layer_tensor(role), p->hf, l, &x0, name, sizeof name);
    const int known = p->weights == KVC_WEIGHTS_NATIVE && p->describe && p->describe(p->file, name, rows, cols, &x0, &s) == KVC_OK;
    *dt = part_dtype(p, known ? &s : NULL);
    *at = known && !p->hf && maps(p, *dt, &s) ? s.data : NULL;
    if (kvc_dtype_is_wtype(*dt)) m->n_native += p->hf ? m->cfg.n_experts : 1; /* tensors of the file */
}

/* views[e] = expert e's [rows, cols] of a stack in dtype dt (at: the file's bytes it is used in place over). */
static kvc_status own_stack(const plan *p, int32_t dt, const void *at, int64_t rows, int64_t cols, const char *what,
                            kvc_view *views) {
    const kvc_backend *be = p->m->be;
    const int32_t E = p->m->cfg.n_experts;
    if (!at && be->wrap_keeps_layout && !be->wrap_keeps_layout(dt)) {
        for (int32_t e = 0; e < E; e++) KVC_TRY(own(p->m, dt, rows * cols, cols, NULL, what, &views[e]));
        return KVC_OK;
    }
    kvc_view whole;
    KVC_TRY(own(p->m, dt, (int64_t)E * rows * cols, cols, at, what, &whole));
    for (int32_t e = 0; e < E; e++) views[e] = kvc_view_at(whole, (int64_t)e * rows, 0);
    return KVC_OK;
}

static kvc_status place_experts(const plan *p, int32_t l, kvc_layer_weights *L) {
    const kvc_config *c = &p->m->cfg;
    const int32_t E = c->n_experts;
    const int64_t D = c->hidden, Fe = c->moe_ffn;
    int32_t dg, du, dd;
    const void *ag, *au, *ad;
    if (!(L->exp_gu = calloc((size_t)E, sizeof *L->exp_gu)) || !(L->exp_down = calloc((size_t)E, sizeof *L->exp_down)))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: expert table");
    KVC_TRY(place1(p, KVC_W_ROUTER, l, E, D, "router", &L->router));
    plan_stack(p, KVC_W_GATE_EXP, l, Fe, D, &dg, &ag);
    plan_stack(p, KVC_W_UP_EXP, l, Fe, D, &du, &au);
    plan_stack(p, KVC_W_DOWN_EXP, l, D, Fe, &dd, &ad);
    kvc_view *v = malloc(sizeof *v * 2 * (size_t)E);
    if (!v) return kvc_fail(KVC_ERR_NOMEM, "out of memory: expert table");
    kvc_status st = KVC_OK;
    const int fused = dg == du && !ag && !au;
    if (fused) st = own_stack(p, dg, NULL, 2 * Fe, D, "expert gate|up weights", v);
    else if ((st = own_stack(p, dg, ag, Fe, D, "expert gate weights", v)) == KVC_OK)
        st = own_stack(p, du, au, Fe, D, "expert up weights", v + E);
    for (int32_t e = 0; e < E && st == KVC_OK; e++) {
        kvc_wgroup *g = &L->exp_gu[e];
        g->n = 2;
        g->rows[0] = g->rows[1] = Fe;
        g->whole = fused ? v[e] : (kvc_view){0};
        g->part[0] = v[e];
        g->part[1] = fused ? kvc_view_at(v[e], Fe, 0) : v[E + e];
    }
    free(v);
    return st == KVC_OK ? own_stack(p, dd, ad, D, Fe, "expert down weights", L->exp_down) : st;
}

kvc_status kvc_wgroup_matmul(const kvc_backend *be, kvc_view a, const kvc_wgroup *g, kvc_view c, int64_t m, int64_t k) {
    if (g->whole.buf) return be->matmul(a, g->whole, c, m, g->rows[0] + g->rows[1] + g->rows[2], k, 0);
    int64_t col = 0;
    for (int i = 0; i < g->n; col += g->rows[i], i++)
        KVC_TRY(be->matmul(a, g->part[i], kvc_view_at(c, 0, col), m, g->rows[i], k, 0));
    return KVC_OK;
}

kvc_status kvc_model_create(const kvc_config *cfg, const char *format, const char *path, const kvc_backend *be,
                            int32_t weights, int hf, kvc_describe_fn describe, const void *file, kvc_model **out) {
    *out = NULL;
    KVC_TRY(check_config(cfg));
    kvc_model *m = calloc(1, sizeof *m);
    if (!m) return kvc_fail(KVC_ERR_NOMEM, "out of memory: model");
    pthread_mutex_init(&m->host_lock, NULL);
    m->cfg = *cfg;
    m->be = be;
    m->kv_format.type = KVC_KV_NATIVE;
    m->weights = weights & ~(KVC_WEIGHTS_NO_MMAP | KVC_WEIGHTS_NO_REPACK);
    snprintf(m->format, sizeof m->format, "%s", format);
    kvc_status st = KVC_OK;
    if (be->check_model) st = be->check_model(cfg);
    if (st == KVC_OK && !(m->path = strdup(path ? path : ""))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: model path");
    const int64_t D = cfg->hidden, F = cfg->ffn, V = cfg->vocab, half = cfg->head_dim / 2;
    const int64_t qd = (int64_t)cfg->n_heads * cfg->head_dim, kd = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    if (st == KVC_OK && weights != KVC_WEIGHTS_FP32 && (weights & ~(KVC_WEIGHTS_NO_MMAP | KVC_WEIGHTS_NO_REPACK)) != KVC_WEIGHTS_NATIVE)
        st = kvc_fail(KVC_ERR_ARG, "weights must be native (%d, | %d: copied, not mapped, | %d: file layout kept) or fp32 (%d), got %d",
                      KVC_WEIGHTS_NATIVE, KVC_WEIGHTS_NO_MMAP, KVC_WEIGHTS_NO_REPACK, KVC_WEIGHTS_FP32, weights);
    static const kvc_weight_role R_QKV[] = {KVC_W_Q, KVC_W_K, KVC_W_V}, R_GU[] = {KVC_W_GATE, KVC_W_UP};
    const int64_t qkv_rows[] = {qd, kd, kd}, gu_rows[] = {F, F};
    const plan p = {m, m->weights, !(weights & KVC_WEIGHTS_NO_MMAP), !(weights & KVC_WEIGHTS_NO_REPACK), hf, describe, file};
    if (st == KVC_OK && !(m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers)))
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: layer table");
    if (st == KVC_OK && (!(m->rope_inv_freq = calloc((size_t)half, sizeof(float))) ||
                         (cfg->rope_long_context > 0 && !(m->rope_inv_freq_long = calloc((size_t)half, sizeof(float)))) ||
                         (cfg->rope_local_theta > 0 && !(m->rope_inv_freq_local = calloc((size_t)half, sizeof(float))))))
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: RoPE frequencies");
    if (st == KVC_OK) st = place1(&p, KVC_W_TOK, -1, V, D, "token embedding", &m->tok_embd);
    if (st == KVC_OK) st = own(m, KVC_F32, D, D, NULL, "output norm", &m->out_norm);
    if (st == KVC_OK) st = own(m, KVC_F32, half, half, NULL, "RoPE frequencies", &m->inv_freq);
    if (st == KVC_OK && cfg->rope_long_context > 0)
        st = own(m, KVC_F32, half, half, NULL, "RoPE frequencies (LongRoPE long factors)", &m->inv_freq_long);
    if (st == KVC_OK && cfg->rope_local_theta > 0)
        st = own(m, KVC_F32, half, half, NULL, "RoPE frequencies (sliding layers)", &m->inv_freq_local);
    if (st == KVC_OK) {
        if (cfg->tied_embeddings) m->lm_head = m->tok_embd;
        else st = place1(&p, KVC_W_LM_HEAD, -1, V, D, "lm_head", &m->lm_head);
    }
    for (int32_t l = 0; l < cfg->n_layers && st == KVC_OK; l++) {
        kvc_layer_weights *L = &m->layers[l];
        st = own(m, KVC_F32, D, D, NULL, "attention norm", &L->attn_norm);
        if (st == KVC_OK)
            st = kvc_fused_proj(cfg) ? place_fused(&p, KVC_W_QKV, l, qkv_rows, 3, D, "q|k|v weights", &L->qkv)
                                     : place(&p, R_QKV, 3, l, qkv_rows, D, "q|k|v weights", &L->qkv);
        if (st == KVC_OK && cfg->qkv_bias) st = own(m, KVC_F32, qd + 2 * kd, qd + 2 * kd, NULL, "q|k|v bias", &L->bqkv);
        if (st == KVC_OK && cfg->qk_norm) st = own(m, KVC_F32, cfg->head_dim, cfg->head_dim, NULL, "q norm", &L->q_norm);
        if (st == KVC_OK && cfg->qk_norm) st = own(m, KVC_F32, cfg->head_dim, cfg->head_dim, NULL, "k norm", &L->k_norm);
        if (st == KVC_OK) st = place1(&p, KVC_W_O, l, D, qd, "o weights", &L->wo);
        if (st == KVC_OK) st = own(m, KVC_F32, D, D, NULL, "MLP norm", &L->ffn_norm);
        if (st == KVC_OK && kvc_layer_moe(cfg, l)) {
            st = place_experts(&p, l, L);
        } else if (st == KVC_OK) {
            st = kvc_fused_proj(cfg) ? place_fused(&p, KVC_W_GU, l, gu_rows, 2, D, "gate|up weights", &L->gu)
                                     : place(&p, R_GU, 2, l, gu_rows, D, "gate|up weights", &L->gu);
            if (st == KVC_OK) st = place1(&p, KVC_W_DOWN, l, D, F, "down weights", &L->wdown);
        }
        if (st == KVC_OK && cfg->post_norms) st = own(m, KVC_F32, D, D, NULL, "attention output norm", &L->post_attn_norm);
        if (st == KVC_OK && cfg->post_norms) st = own(m, KVC_F32, D, D, NULL, "MLP output norm", &L->post_ffn_norm);
    }
    if (st != KVC_OK) {
        kvc_model_free(m);
        return st;
    }
    *out = m;
    return KVC_OK;
}

float *kvc_model_rope_factors(kvc_model *m) {
    if (!m->rope_factors) m->rope_factors = kvc_calloc((size_t)m->cfg.head_dim / 2, sizeof(float), "rope factors");
    return m->rope_factors;
}

float *kvc_model_rope_long_factors(kvc_model *m) {
    if (!m->rope_long_factors) m->rope_long_factors = kvc_calloc((size_t)m->cfg.head_dim / 2, sizeof(float), "rope factors");
    return m->rope_long_factors;
}

/* The view and the row range a role's tensor fills, and the shape it must have. */
const kvc_layer_tensor kvc_layer_tensors[KVC_LAYER_TENSORS] = {
    {KVC_W_ATTN_NORM, "attn_norm.weight", "input_layernorm.weight"},
    {KVC_W_Q, "attn_q.weight", "self_attn.q_proj.weight"},
    {KVC_W_K, "attn_k.weight", "self_attn.k_proj.weight"},
    {KVC_W_V, "attn_v.weight", "self_attn.v_proj.weight"},
    {KVC_W_O, "attn_output.weight", "self_attn.o_proj.weight"},
    {KVC_W_BQ, "attn_q.bias", "self_attn.q_proj.bias"},
    {KVC_W_BK, "attn_k.bias", "self_attn.k_proj.bias"},
    {KVC_W_BV, "attn_v.bias", "self_attn.v_proj.bias"},
    {KVC_W_FFN_NORM, "ffn_norm.weight", "post_attention_layernorm.weight"},
    {KVC_W_GATE, "ffn_gate.weight", "mlp.gate_proj.weight"},
    {KVC_W_UP, "ffn_up.weight", "mlp.up_proj.weight"},
    {KVC_W_DOWN, "ffn_down.weight", "mlp.down_proj.weight"},
    {KVC_W_Q_NORM, "attn_q_norm.weight", "self_attn.q_norm.weight"},
    {KVC_W_K_NORM, "attn_k_norm.weight", "self_attn.k_norm.weight"},
    {KVC_W_QKV, "attn_qkv.weight", "self_attn.qkv_proj.weight"},
    {KVC_W_GU, "ffn_up.weight", "mlp.gate_up_proj.weight"}, /* llama.cpp's phi3 keeps gate|up fused as ffn_up */
    {KVC_W_POST_ATTN_NORM, "post_attention_norm.weight", "post_attention_layernorm.weight"},
    {KVC_W_POST_FFN_NORM, "post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
    /* GGUF keeps each expert role as one 3-D tensor [E, rows, cols] (ggml order reversed) */
    {KVC_W_ROUTER, "ffn_gate_inp.weight", "mlp.gate.weight"},
    {KVC_W_GATE_EXP, "ffn_gate_exps.weight", "mlp.experts.%d.gate_proj.weight"},
    {KVC_W_UP_EXP, "ffn_up_exps.weight", "mlp.experts.%d.up_proj.weight"},
    {KVC_W_DOWN_EXP, "ffn_down_exps.weight", "mlp.experts.%d.down_proj.weight"},
};

const char *kvc_layer_tensor_name(const kvc_config *c, const kvc_layer_tensor *t, int hf) {
    if (hf && c->post_norms && t->role == KVC_W_FFN_NORM) return "pre_feedforward_layernorm.weight";
    if (hf && c->arch == KVC_ARCH_MIXTRAL)
        switch (t->role) {
        case KVC_W_ROUTER: return "block_sparse_moe.gate.weight";
        case KVC_W_GATE_EXP: return "block_sparse_moe.experts.%d.w1.weight";
        case KVC_W_UP_EXP: return "block_sparse_moe.experts.%d.w3.weight";
        case KVC_W_DOWN_EXP: return "block_sparse_moe.experts.%d.w2.weight";
        default: break;
        }
    return hf ? t->hf : t->gguf;
}

static int expert_role(kvc_weight_role r) { return r == KVC_W_GATE_EXP || r == KVC_W_UP_EXP || r == KVC_W_DOWN_EXP; }

void kvc_layer_tensor_path(const kvc_config *c, const kvc_layer_tensor *t, int hf, int32_t l, const kvc_expert *x,
                           char *buf, size_t cap) {
    char tail[128];
    const char *fmt = kvc_layer_tensor_name(c, t, hf);
    if (hf && expert_role(t->role)) snprintf(tail, sizeof tail, fmt, x ? (int)x->e : 0);
    else snprintf(tail, sizeof tail, "%s", fmt);
    snprintf(buf, cap, hf ? "model.layers.%d.%s" : "blk.%d.%s", (int)l, tail);
}

static const kvc_layer_tensor *layer_tensor(kvc_weight_role role) {
    for (int i = 0; i < KVC_LAYER_TENSORS; i++)
        if (kvc_layer_tensors[i].role == role) return &kvc_layer_tensors[i];
    return &kvc_layer_tensors[0]; /* not reached: every per-layer role has a row */
}

/* The shape of a role's tensor the config implies: [rows, cols], rows 0 for a vector. */
static void shape(const kvc_model *m, kvc_weight_role role, int64_t *rows, int64_t *cols) {
    const kvc_config *c = &m->cfg;
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    *rows = 0;
    *cols = 0;
    switch (role) {
    case KVC_W_TOK: case KVC_W_LM_HEAD: *rows = c->vocab; *cols = D; break;
    case KVC_W_OUT_NORM: case KVC_W_ATTN_NORM: case KVC_W_FFN_NORM: case KVC_W_POST_ATTN_NORM: case KVC_W_POST_FFN_NORM:
        *cols = D;
        break;
    case KVC_W_Q: *rows = qd; *cols = D; break;
    case KVC_W_K: case KVC_W_V: *rows = kd; *cols = D; break;
    case KVC_W_O: *rows = D; *cols = qd; break;
    case KVC_W_BQ: *cols = qd; break;
    case KVC_W_BK: case KVC_W_BV: *cols = kd; break;
    case KVC_W_GATE: case KVC_W_UP: *rows = F; *cols = D; break;
    case KVC_W_DOWN: *rows = D; *cols = F; break;
    case KVC_W_Q_NORM: case KVC_W_K_NORM: *cols = c->head_dim; break;
    case KVC_W_QKV: *rows = qd + 2 * kd; *cols = D; break;
    case KVC_W_GU: *rows = 2 * F; *cols = D; break;
    case KVC_W_ROUTER: *rows = c->n_experts; *cols = D; break;
    case KVC_W_GATE_EXP: case KVC_W_UP_EXP: *rows = c->moe_ffn; *cols = D; break;
    case KVC_W_DOWN_EXP: *rows = D; *cols = c->moe_ffn; break;
    }
}

/* A role's tensor name: the file-level ones in full, the per-layer ones after "blk.N." / "model.layers.N.". */
static const char *role_name(const kvc_config *c, kvc_weight_role role, int hf) {
    if (role == KVC_W_TOK) return hf ? "model.embed_tokens.weight" : "token_embd.weight";
    if (role == KVC_W_LM_HEAD) return hf ? "lm_head.weight" : "output.weight";
    for (int i = 0; i < KVC_LAYER_TENSORS; i++)
        if (kvc_layer_tensors[i].role == role) return kvc_layer_tensor_name(c, &kvc_layer_tensors[i], hf);
    return "";
}

kvc_status kvc_model_put_layers(kvc_model *m, int hf, kvc_put_fn put, const void *file) {
    char name[200];
    const kvc_config *c = &m->cfg;
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int i = 0; i < KVC_LAYER_TENSORS; i++) {
            const kvc_layer_tensor *t = &kvc_layer_tensors[i];
            if ((t->role == KVC_W_BQ || t->role == KVC_W_BK || t->role == KVC_W_BV) && !c->qkv_bias) continue;
            if ((t->role == KVC_W_Q_NORM || t->role == KVC_W_K_NORM) && !c->qk_norm) continue;
            if ((t->role == KVC_W_POST_ATTN_NORM || t->role == KVC_W_POST_FFN_NORM) && !c->post_norms) continue;
            const int fused_role = t->role == KVC_W_QKV || t->role == KVC_W_GU;
            const int part_role = t->role == KVC_W_Q || t->role == KVC_W_K || t->role == KVC_W_V || t->role == KVC_W_GATE ||
                                  t->role == KVC_W_UP;
            if (kvc_fused_proj(c) ? part_role : fused_role) continue;
            const int dense_mlp = t->role == KVC_W_GATE || t->role == KVC_W_UP || t->role == KVC_W_DOWN || t->role == KVC_W_GU;
            const int moe_role = t->role == KVC_W_ROUTER || expert_role(t->role);
            if (kvc_layer_moe(c, l) ? dense_mlp : moe_role) continue;
            int64_t rows, cols;
            shape(m, t->role, &rows, &cols);
            for (int32_t e = 0; e < (expert_role(t->role) ? c->n_experts : 1); e++) {
                const kvc_expert x = {e, c->n_experts};
                kvc_layer_tensor_path(c, t, hf, l, &x, name, sizeof name);
                KVC_TRY(put(file, m, t->role, l, name, rows, cols, expert_role(t->role) ? &x : NULL));
            }
        }
    return KVC_OK;
}

/* The view a role's tensor goes to (an expert role: expert `expert`'s), and its logical shape (a vector: one row). */
static kvc_status target(const kvc_model *m, kvc_weight_role role, int32_t layer, int32_t expert, kvc_view *v, int64_t *rows,
                         int64_t *cols) {
    const kvc_config *c = &m->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    if (role < KVC_W_TOK || role > KVC_W_DOWN_EXP) return kvc_fail(KVC_ERR_INTERNAL, "unknown weight role %d", (int)role);
    if (role >= KVC_W_ATTN_NORM && (layer < 0 || layer >= c->n_layers))
        return kvc_fail(KVC_ERR_INTERNAL, "weight of layer %d outside [0, %d)", layer, c->n_layers);
    const kvc_layer_weights *L = role >= KVC_W_ATTN_NORM ? &m->layers[layer] : NULL;
    if (expert_role(role) != (expert >= 0) || expert >= c->n_experts || (expert >= 0 && !L->exp_gu))
        return kvc_fail(KVC_ERR_INTERNAL, "weight role %d of expert %d in layer %d", (int)role, expert, layer);
    switch (role) {
    case KVC_W_TOK: *v = m->tok_embd; break;
    case KVC_W_OUT_NORM: *v = m->out_norm; break;
    case KVC_W_LM_HEAD: *v = m->lm_head; break;
    case KVC_W_ATTN_NORM: *v = L->attn_norm; break;
    case KVC_W_Q: *v = L->qkv.part[0]; break;
    case KVC_W_K: *v = L->qkv.part[1]; break;
    case KVC_W_V: *v = L->qkv.part[2]; break;
    case KVC_W_O: *v = L->wo; break;
    case KVC_W_BQ: *v = L->bqkv; break;
    case KVC_W_BK: *v = kvc_view_at(L->bqkv, 0, qd); break;
    case KVC_W_BV: *v = kvc_view_at(L->bqkv, 0, qd + kd); break;
    case KVC_W_FFN_NORM: *v = L->ffn_norm; break;
    case KVC_W_GATE: *v = L->gu.part[0]; break;
    case KVC_W_UP: *v = L->gu.part[1]; break;
    case KVC_W_DOWN: *v = L->wdown; break;
    case KVC_W_Q_NORM: *v = L->q_norm; break;
    case KVC_W_K_NORM: *v = L->k_norm; break;
    case KVC_W_QKV: *v = L->qkv.whole; break;
    case KVC_W_GU: *v = L->gu.whole; break;
    case KVC_W_POST_ATTN_NORM: *v = L->post_attn_norm; break;
    case KVC_W_POST_FFN_NORM: *v = L->post_ffn_norm; break;
    case KVC_W_ROUTER: *v = L->router; break;
    case KVC_W_GATE_EXP: *v = L->exp_gu[expert].part[0]; break;
    case KVC_W_UP_EXP: *v = L->exp_gu[expert].part[1]; break;
    case KVC_W_DOWN_EXP: *v = L->exp_down[expert]; break;
    }
    if (!v->buf) return kvc_fail(KVC_ERR_INTERNAL, "weight role %d has no buffer in this model", (int)role);
    shape(m, role, rows, cols);
    if (*rows == 0) *rows = 1;
    return KVC_OK;
}

/* Give the file pages of a converted tensor back to the kernel: a large model streamed through the
 * mapping must not stay resident (they are clean file pages; a later read maps them again). */
static void release_pages(const void *data, size_t bytes) {
    const long page = sysconf(_SC_PAGESIZE);
    if (page <= 0 || bytes < (size_t)page) return;
    const uintptr_t lo = ((uintptr_t)data + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    const uintptr_t hi = ((uintptr_t)data + bytes) & ~((uintptr_t)page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static int is_norm(kvc_weight_role r) {
    return r == KVC_W_OUT_NORM || r == KVC_W_ATTN_NORM || r == KVC_W_FFN_NORM || r == KVC_W_Q_NORM || r == KVC_W_K_NORM ||
           r == KVC_W_POST_ATTN_NORM || r == KVC_W_POST_FFN_NORM;
}

static const kvc_model_buf *model_buf(const kvc_model *m, const kvc_buf *b) {
    for (size_t i = 0; i < m->n_bufs; i++)
        if (m->bufs[i].buf == b) return &m->bufs[i];
    return NULL;
}

kvc_status kvc_model_put(kvc_model *m, kvc_weight_role role, int32_t layer, int32_t expert, const kvc_src *src) {
    kvc_view v = {0};
    int64_t rows = 0, cols = 0;
    KVC_TRY(target(m, role, layer, expert, &v, &rows, &cols));
    if (src->rows != rows || src->cols != cols)
        return kvc_fail(KVC_ERR_FORMAT, "tensor '%s' is [%lld, %lld], the config implies [%lld, %lld]", src->name,
                        (long long)src->rows, (long long)src->cols, (long long)rows, (long long)cols);
    const kvc_model_buf *mb = model_buf(m, v.buf);
    const int32_t dtype = mb ? mb->dtype : -1;
    const int native = kvc_dtype_is_wtype(dtype);
    if (native && expert > 0 && src->ggml_type != dtype - KVC_WTYPE_BASE) /* planned from expert 0 */
        return kvc_fail(KVC_ERR_UNSUPPORTED, "tensor '%s' has another type than expert 0's: the experts of a layer must "
                        "share one type to be held in it (load with weights=\"fp32\")", src->name);
    if (native && (src->ggml_type != dtype - KVC_WTYPE_BASE || !src->data))
        return kvc_fail(KVC_ERR_INTERNAL, "tensor '%s': its type changed between planning and loading", src->name);
    /* a mapped weight is the file's bytes already: only checked below */
    const int mapped = mb && mb->mapped;
    if (mapped && (const char *)mb->mapped + dtype_bytes(dtype, v.off) != (const char *)src->data)
        return kvc_fail(KVC_ERR_INTERNAL, "tensor '%s': its place in the file changed between planning and loading", src->name);
    int64_t step = CHUNK_FLOATS / cols;
    if (step < 1) step = 1;
    if (step > rows) step = rows;
    float *chunk = kvc_malloc(sizeof(float) * (size_t)(step * cols), "weight conversion chunk");
    if (!chunk) return KVC_ERR_NOMEM;
    kvc_status st = KVC_OK;
    for (int64_t r0 = 0; r0 < rows && st == KVC_OK; r0 += step) {
        const int64_t nr = rows - r0 < step ? rows - r0 : step;
        st = src->decode(src, r0, nr, chunk);
        if (st == KVC_OK) {
            for (int64_t i = 0; i < nr * cols; i++)
                if (!isfinite(chunk[i])) {
                    st = kvc_fail(KVC_ERR_FORMAT, "tensor '%s' holds a non-finite value at row %lld: the file is corrupt",
                                  src->name, (long long)(r0 + i / cols));
                    break;
                }
        }
        if (st == KVC_OK && m->norm_plus_one && is_norm(role)) /* Gemma's HF norms: used as 1 + w, in fp32 as transformers */
            for (int64_t i = 0; i < nr * cols; i++) chunk[i] += 1.0f;
        if (mapped) continue; /* its pages stay: they are the weights */
        /* a vector's one row is the whole [1, cols] range of its view; a native weight takes the file's
         * bytes (decoded above only to check them) */
        if (st == KVC_OK && permutes(&m->cfg, role)) { /* partial rotary: row by row to the engine's rows */
            for (int64_t i = 0; i < nr && st == KVC_OK; i++) {
                const kvc_view to = kvc_view_at(v, engine_row(&m->cfg, role, r0 + i), 0);
                st = native ? m->be->upload(to, 1, cols, (const char *)src->data + (size_t)(r0 + i) * src->row_bytes, dtype)
                            : m->be->upload(to, 1, cols, chunk + i * cols, KVC_F32);
            }
        } else if (st == KVC_OK && native)
            st = m->be->upload(kvc_view_at(v, r0, 0), nr, cols, (const char *)src->data + (size_t)r0 * src->row_bytes, dtype);
        else if (st == KVC_OK) st = m->be->upload(kvc_view_at(v, r0, 0), nr, cols, chunk, KVC_F32);
        if (st == KVC_OK && src->data) release_pages((const char *)src->data + (size_t)r0 * src->row_bytes, (size_t)nr * src->row_bytes);
    }
    kvc_free(chunk);
    return st;
}

kvc_status kvc_kernel_rope_freqs(const kvc_config *c, float *inv_freq) {
    if (!c || !inv_freq) return kvc_fail(KVC_ERR_ARG, "rope_freqs: null argument");
    if (c->head_dim <= 0 || c->head_dim % 2) return kvc_fail(KVC_ERR_ARG, "rope_freqs: head_dim must be even and positive");
    const int half = c->head_dim / 2, rot = c->rope_dim > 0 ? c->rope_dim : c->head_dim;
    for (int i = 0; i < half; i++) {
        if (i >= rot / 2) { /* partial rotary: the passed-through values (model.h) */
            inv_freq[i] = 0.0f;
            continue;
        }
        double f = pow((double)c->rope_theta, -(2.0 * i) / rot);
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

/* The frequencies divided by per-frequency factors (those of the turned pairs; the others stay 0). */
static kvc_status divide(const kvc_config *c, float *freq, const float *factors, const char *what) {
    const int turned = (c->rope_dim > 0 ? c->rope_dim : c->head_dim) / 2;
    for (int i = 0; i < turned; i++) {
        if (!(factors[i] > 0) || !isfinite(factors[i]))
            return kvc_fail(KVC_ERR_FORMAT, "%s has a non-positive or non-finite factor at %d", what, i);
        freq[i] /= factors[i];
    }
    return KVC_OK;
}

/* x rounded to nearest (ties to even) with `bits` significant bits: a bf16 (8) or f16 (11) value of it. */
static float round_significand(float x, int bits) {
    int e;
    const double f = frexp((double)x, &e); /* x = f 2^e, f in [0.5, 1) */
    return (float)ldexp(nearbyint(ldexp(f, bits)), e - bits);
}

kvc_status kvc_model_finish(kvc_model *m) {
    if (m->embed_scale_rounded && m->cfg.embed_scale > 0) { /* transformers: embed_scale.to(weight.dtype) */
        const kvc_model_buf *b = model_buf(m, m->tok_embd.buf);
        const int32_t t = b ? b->dtype : KVC_F32;
        if (t == KVC_BF16 || t == KVC_WTYPE(GGML_T_BF16)) m->cfg.embed_scale = round_significand(m->cfg.embed_scale, 8);
        else if (t == KVC_WTYPE(GGML_T_F16)) m->cfg.embed_scale = round_significand(m->cfg.embed_scale, 11);
    }
    const kvc_config *c = &m->cfg;
    const int half = c->head_dim / 2;
    KVC_TRY(kvc_kernel_rope_freqs(c, m->rope_inv_freq));
    if (c->rope_long_context > 0) { /* LongRoPE: inv_freq = 1 / (factor * theta^(2i/rot)), short and long */
        if (!m->rope_factors || !m->rope_long_factors)
            return kvc_fail(KVC_ERR_INTERNAL, "LongRoPE model without its short and long factors");
        float *lf = m->rope_inv_freq_long;
        memcpy(lf, m->rope_inv_freq, sizeof(float) * (size_t)half);
        KVC_TRY(divide(c, lf, m->rope_long_factors, "LongRoPE's long_factor"));
        KVC_TRY(m->be->upload(m->inv_freq_long, 1, half, lf, KVC_F32));
    }
    if (c->rope_local_theta > 0) { /* the sliding layers' own base, unscaled (Gemma 3's rope_local_base_freq) */
        kvc_config local = *c;
        local.rope_theta = c->rope_local_theta;
        local.rope_scaling_factor = 0;
        KVC_TRY(kvc_kernel_rope_freqs(&local, m->rope_inv_freq_local));
        KVC_TRY(m->be->upload(m->inv_freq_local, 1, half, m->rope_inv_freq_local, KVC_F32));
    }
    /* GGUF stores Llama-3.1 scaling as per-frequency divisors; LongRoPE's short factors are the same */
    if (m->rope_factors) KVC_TRY(divide(c, m->rope_inv_freq, m->rope_factors, c->rope_long_context ? "LongRoPE's short_factor" : "rope_freqs.weight"));
    return m->be->upload(m->inv_freq, 1, half, m->rope_inv_freq, KVC_F32);
}

int kvc_rope_long(const kvc_config *c, int64_t end) { return c->rope_long_context > 0 && end > c->rope_long_context; }

kvc_rope_rule kvc_model_rope(const kvc_model *m, int32_t l, int64_t end) {
    const kvc_config *c = &m->cfg;
    kvc_rope_rule r = {m->inv_freq, m->rope_inv_freq, c->rope_attn_factor > 0 ? c->rope_attn_factor : 1.0f};
    if (m->inv_freq_local.buf && kvc_layer_slides(c, l)) {
        r.freq = m->inv_freq_local;
        r.host = m->rope_inv_freq_local;
    } else if (kvc_rope_long(c, end)) {
        r.freq = m->inv_freq_long;
        r.host = m->rope_inv_freq_long;
    }
    return r;
}

static void host_weights_free(kvc_host_weights *h) {
    if (!h) return;
    free(h->layers);
    free(h);
}

void kvc_model_free(kvc_model *m) {
    if (!m) return;
    kvc_backend_lock(m->be);
    for (size_t i = 0; i < m->n_bufs; i++) m->be->free(m->bufs[i].buf);
    kvc_backend_unlock(m->be);
    free(m->bufs);
    for (int32_t l = 0; m->layers && l < m->cfg.n_layers; l++) {
        free(m->layers[l].exp_gu);
        free(m->layers[l].exp_down);
    }
    free(m->layers);
    kvc_free(m->rope_factors);
    kvc_free(m->rope_long_factors);
    free(m->rope_inv_freq);
    free(m->rope_inv_freq_long);
    free(m->rope_inv_freq_local);
    free(m->path);
    host_weights_free(m->host);
    kvc_model_free(m->host_twin);
    /* the mappings last: buffers above may have wrapped them */
    if (m->files) m->close_files(m->files);
    if (m->meta) gguf_close(m->meta);
    pthread_mutex_destroy(&m->host_lock);
    free(m);
}

static const float *host_at(const kvc_backend *be, kvc_view v) {
    const float *p = v.buf ? be->host_f32(v.buf) : NULL;
    return p ? p + v.off : NULL;
}

/* Pointers into the model's own buffers when the backend keeps them as host f32 (the CPU), else NULL. */
static kvc_host_weights *host_view(const kvc_model *m) {
    const kvc_backend *be = m->be;
    const kvc_config *c = &m->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
#define HOST(view) host_at(be, (view))
    if (!HOST(m->tok_embd) || m->n_native > 0) return NULL; /* a native matrix anywhere: the fp32 twin */
    kvc_host_weights *h = calloc(1, sizeof *h);
    if (h) h->layers = calloc((size_t)c->n_layers, sizeof *h->layers);
    if (!h || !h->layers) {
        host_weights_free(h);
        return NULL;
    }
    h->tok_embd = HOST(m->tok_embd);
    h->out_norm = HOST(m->out_norm);
    h->lm_head = HOST(m->lm_head);
    h->rope = m;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kvc_layer_weights *W = &m->layers[l];
        kvc_host_layer *H = &h->layers[l];
        H->attn_norm = HOST(W->attn_norm);
        H->wq = HOST(W->qkv.part[0]);
        H->wk = HOST(W->qkv.part[1]);
        H->wv = HOST(W->qkv.part[2]);
        H->wo = HOST(W->wo);
        if (W->bqkv.buf) {
            H->bq = HOST(W->bqkv);
            H->bk = H->bq + qd;
            H->bv = H->bk + kd;
        }
        if (W->q_norm.buf) {
            H->q_norm = HOST(W->q_norm);
            H->k_norm = HOST(W->k_norm);
        }
        H->ffn_norm = HOST(W->ffn_norm);
        H->w_gate = HOST(W->gu.part[0]);
        H->w_up = HOST(W->gu.part[1]);
        H->w_down = HOST(W->wdown);
    }
#undef HOST
    return h;
}

kvc_status kvc_model_host_weights(kvc_model *m, const kvc_host_weights **out) {
    *out = NULL;
    /* the host pass turns its rows by the forward's rule (kvc_model_rope), but is tested on plain RoPE only */
    if (m->cfg.rope_long_context > 0)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "host-side weights (Judge Q's backward) do not support LongRoPE models yet");
    /* nor Gemma's layer (norms after attention and MLP, GeGLU, a RoPE base per layer kind, scaled embeddings,
     * soft-capping) */
    if (m->cfg.post_norms || m->cfg.mlp_act != KVC_MLP_SILU || m->cfg.rope_local_theta > 0 || m->cfg.embed_scale > 0 ||
        m->cfg.attn_scale > 0 || m->cfg.attn_softcap > 0 || m->cfg.logit_softcap > 0)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "host-side weights (Judge Q's backward, KVgrad, RestoreKV) do not support Gemma 2 and "
                        "Gemma 3 models yet");
    /* nor an MLP of experts */
    if (m->cfg.n_experts > 0)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "host-side weights (Judge Q's backward, KVgrad, RestoreKV) do not support "
                        "mixture-of-experts models yet");
    pthread_mutex_lock(&m->host_lock);
    kvc_status st = KVC_OK;
    if (!m->host && !(m->host = host_view(m))) {
        /* a device model or native weights: an fp32 CPU copy of the file, once (4 bytes per parameter
         * of host memory) */
        if (!m->host_twin) st = kvc_model_load_ex(m->path, KVC_DEVICE_CPU, KVC_WEIGHTS_FP32, &m->host_twin);
        if (st == KVC_OK && !(m->host = host_view(m->host_twin)))
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: host weights");
    }
    pthread_mutex_unlock(&m->host_lock);
    if (st == KVC_OK) *out = m->host;
    return st;
}

kvc_model *kvc_model_host_model(kvc_model *m) { return m->host_twin ? m->host_twin : m; }

kvc_status kvc_model_load_ex(const char *path, int32_t device, int32_t weights, kvc_model **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_model_load: out is NULL");
    *out = NULL;
    if (!path || !*path) return kvc_fail(KVC_ERR_ARG, "model path is empty");
    const kvc_backend *be = NULL;
    KVC_TRY(kvc_backend_get(device, &be)); /* fail before reading the file */
    struct stat st;
    if (stat(path, &st) != 0)
        return kvc_fail(KVC_ERR_IO, "model path '%s' does not exist: give a .gguf file or a Hugging Face folder", path);
    /* A device's scratch and stream are shared: a load must not interleave with another thread's forward. */
    kvc_backend_lock(be);
    kvc_status status = S_ISDIR(st.st_mode) ? kvc_load_hf(path, be, weights, out) : kvc_load_gguf(path, be, weights, out);
    kvc_backend_unlock(be);
    return status;
}

kvc_status kvc_model_load_device(const char *path, int32_t device, kvc_model **out) {
    return kvc_model_load_ex(path, device, KVC_WEIGHTS_NATIVE, out);
}

int32_t kvc_model_weights(const kvc_model *m, int32_t *n_native) {
    if (n_native) *n_native = m ? m->n_native : 0;
    return m ? m->weights : KVC_WEIGHTS_NATIVE;
}

kvc_status kvc_model_load(const char *path, kvc_model **out) { return kvc_model_load_device(path, KVC_DEVICE_CPU, out); }

int32_t kvc_model_device(const kvc_model *m) { return m ? m->be->device : KVC_DEVICE_CPU; }

kvc_status kvc_model_get_config(const kvc_model *m, kvc_config *out) {
    if (!m || !out) return kvc_fail(KVC_ERR_ARG, "kvc_model_get_config: null argument");
    *out = m->cfg;
    return KVC_OK;
}

int32_t kvc_model_layer_moe(const kvc_model *m, int32_t l) { return m && l >= 0 && l < m->cfg.n_layers && kvc_layer_moe(&m->cfg, l); }

size_t kvc_model_weight_bytes(const kvc_model *m) { return m ? m->weight_bytes : 0; }
size_t kvc_model_mapped_bytes(const kvc_model *m) { return m ? m->mapped_bytes : 0; }
const char *kvc_model_format(const kvc_model *m) { return m ? m->format : ""; }

kvc_status kvc_model_token_embeddings(const kvc_model *model, const int32_t *ids, int64_t n, float *out) {
    if (!model || !out || (n > 0 && !ids))
        return kvc_fail(KVC_ERR_ARG, "kvc_model_token_embeddings: model, ids and out must not be NULL");
    if (n < 0) return kvc_fail(KVC_ERR_ARG, "kvc_model_token_embeddings: negative count %lld", (long long)n);
    const int64_t D = model->cfg.hidden;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= model->cfg.vocab)
            return kvc_fail(KVC_ERR_ARG, "token id %d at index %lld is outside the vocabulary [0, %d)", ids[i],
                            (long long)i, model->cfg.vocab);
    kvc_backend_lock(model->be);
    kvc_status st = KVC_OK;
    for (int64_t i = 0; i < n && st == KVC_OK; i++)
        st = model->be->download(kvc_view_at(model->tok_embd, ids[i], 0), 1, D, out + i * D, KVC_F32);
    kvc_backend_unlock(model->be);
    return st;
}

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
