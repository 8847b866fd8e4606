/* The decoder forward pass: embeddings, N x (RMSNorm, attention over the ragged cache, SwiGLU MLP),
 * final norm, logits. Prefill is batched (all new tokens at once through every GEMM); the MLP runs in
 * row blocks so activations stay O(block x ffn) whatever the prompt length. */
#include <math.h>
#include <string.h>
#include <time.h>

#include "../backend/cuda_loader.h"
#include "session.h"

#define MLP_ROWS 256

/* on_device: a session of a model placed on the GPU runs there (cuda_session.c) */
static kvc_status session_create(kvc_model *model, int64_t capacity_hint, int on_device, kvc_session **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: out is NULL");
    *out = NULL;
    if (!model) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: model is NULL");
    if (capacity_hint < 0) return kvc_fail(KVC_ERR_ARG, "capacity_hint must be >= 0");
    kvc_session *s = calloc(1, sizeof *s);
    if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: session");
    s->model = model;
    s->be = kvc_cpu_backend();
    s->capacity_hint = capacity_hint;
    kvc_status st = kvc_cache_init(&s->cache, model->cfg.n_layers, model->cfg.n_kv_heads, model->cfg.head_dim);
    if (st != KVC_OK) {
        free(s);
        return st;
    }
    if (on_device && model->cuda) {
        st = kvc_dev_session_new(s, capacity_hint);
        if (st != KVC_OK) {
            kvc_cache_free(&s->cache);
            free(s);
            return st;
        }
    }
    *out = s;
    return KVC_OK;
}

kvc_status kvc_session_new(kvc_model *model, int64_t capacity_hint, kvc_session **out) {
    return session_create(model, capacity_hint, 1, out);
}

kvc_status kvc_session_new_cpu(kvc_model *model, int64_t capacity_hint, kvc_session **out) {
    return session_create(model, capacity_hint, 0, out);
}

void kvc_session_free(kvc_session *s) {
    if (!s) return;
    if (s->hook_free) s->hook_free(s->hook_user);
    if (s->dev) kvc_dev_session_free(s);
    kvc_cache_free(&s->cache);
    kvc_free(s->buf);
    free(s->positions);
    free(s);
}

void kvc_session_reset(kvc_session *s) {
    if (!s) return;
    if (s->dev) kvc_dev_session_reset(s);
    kvc_cache_clear(&s->cache);
    s->press_seconds = 0.0;
    s->pos = 0;
    s->needs_reset = 0;
}

int64_t kvc_session_position(const kvc_session *s) { return s ? s->pos : 0; }

kvc_status kvc_session_set_position(kvc_session *s, int64_t position) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0, got %lld", (long long)position);
    s->pos = position;
    return KVC_OK;
}

int64_t kvc_session_cache_len(const kvc_session *s, int32_t layer, int32_t h) {
    if (!s || layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv) return -1;
    if (s->dev) return kvc_dev_cache_len(s, layer, h);
    return s->cache.layers[layer].len[h];
}

double kvc_session_press_seconds(const kvc_session *s) { return s ? s->press_seconds : 0.0; }

size_t kvc_session_cache_bytes(const kvc_session *s) {
    return s ? (s->dev ? kvc_dev_cache_bytes(s) : s->cache.bytes) : 0;
}
size_t kvc_session_peak_cache_bytes(const kvc_session *s) {
    return s ? (s->dev ? kvc_dev_peak_cache_bytes(s) : s->cache.peak_bytes) : 0;
}

/* Scratch layout for n tokens (floats). */
typedef struct scratch {
    float *x, *xn, *q, *k, *v, *att, *o, *resid, *gate, *up;
} scratch;

static kvc_status scratch_get(kvc_session *s, int64_t n, scratch *sc) {
    const kvc_config *c = &s->model->cfg;
    const size_t D = c->hidden, qd = (size_t)c->n_heads * c->head_dim, kd = (size_t)c->n_kv_heads * c->head_dim;
    const size_t blk = (size_t)(n < MLP_ROWS ? n : MLP_ROWS);
    const size_t sizes[10] = {n * D, n * D, n * qd, n * kd, n * kd, n * qd, n * D, n * D,
                              blk * c->ffn, blk * c->ffn};
    size_t total = 0;
    for (int i = 0; i < 10; i++) total += (sizes[i] + 15) & ~(size_t)15;
    if (total > s->buf_floats) {
        kvc_free(s->buf);
        s->buf = kvc_malloc(total * sizeof(float), "activations");
        s->buf_floats = s->buf ? total : 0;
        if (!s->buf) return KVC_ERR_NOMEM;
    }
    float **slots[10] = {&sc->x, &sc->xn, &sc->q, &sc->k, &sc->v, &sc->att, &sc->o, &sc->resid, &sc->gate, &sc->up};
    float *p = s->buf;
    for (int i = 0; i < 10; i++) {
        *slots[i] = p;
        p += (sizes[i] + 15) & ~(size_t)15;
    }
    if ((size_t)n > s->positions_cap) {
        int64_t *np = realloc(s->positions, sizeof(int64_t) * n);
        if (!np) return kvc_fail(KVC_ERR_NOMEM, "out of memory: positions");
        s->positions = np;
        s->positions_cap = n;
    }
    return KVC_OK;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The press hook, timed: a press's own cost, apart from the forward it rides on (benchmarks). */
static kvc_status run_hook(kvc_session *s, const kvc_layer_ctx *ctx) {
    const double t0 = now_seconds();
    kvc_status st = s->hook(s->hook_user, s, ctx);
    s->press_seconds += now_seconds() - t0;
    return st;
}

/* x += MLP(rmsnorm(x)) for n rows, in row blocks of MLP_ROWS (bounded gate/up scratch). */
static void mlp_block(const kvc_backend *be, const kvc_layer_weights *W, const kvc_config *c, const scratch *sc,
                      int64_t n) {
    const int64_t D = c->hidden, F = c->ffn;
    be->rmsnorm(sc->x, W->ffn_norm, sc->xn, n, D, c->rms_eps);
    for (int64_t r0 = 0; r0 < n; r0 += MLP_ROWS) {
        const int64_t rows = n - r0 < MLP_ROWS ? n - r0 : MLP_ROWS;
        be->matmul(sc->xn + r0 * D, W->w_gate, sc->gate, rows, F, D);
        be->matmul(sc->xn + r0 * D, W->w_up, sc->up, rows, F, D);
        be->swiglu(sc->gate, sc->up, sc->gate, rows, F);
        be->matmul(sc->gate, W->w_down, sc->o + r0 * D, rows, D, F);
    }
    be->add(sc->x, sc->o, n * D);
}

/* A follower of a shared forward (kvc_forward_shared) takes this layer's new K/V rows into its own
 * cache and lets its own press act, as if it had computed the layer itself: a press acts after the
 * layer's attention, so the hidden states of the leader and of every follower are the same. */
static kvc_status follower_layer(kvc_session *f, int32_t l, int64_t n, const int64_t *positions, const scratch *sc) {
    const int32_t Hkv = f->cache.n_kv;
    KVC_TRY(kvc_cache_reserve(&f->cache, l, n));
    int64_t past[64];
    for (int32_t h = 0; h < Hkv; h++) past[h] = f->cache.layers[l].len[h];
    kvc_cache_append(&f->cache, l, sc->k, sc->v, positions, n);
    if (!f->hook) return KVC_OK;
    kvc_layer_ctx ctx = {l, n, past, sc->q, sc->att, sc->o, sc->resid};
    return run_hook(f, &ctx);
}

/* One layer on n tokens; x [n, D] is updated in place. */
static kvc_status layer_forward(kvc_session *s, int32_t l, int64_t n, scratch *sc) {
    const kvc_model *m = s->model;
    const kvc_config *c = &m->cfg;
    const kvc_backend *be = s->be;
    const kvc_layer_weights *W = &m->layers[l];
    const int64_t D = c->hidden, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t qd = H * d, kd = Hkv * d;

    /* attention block */
    memcpy(sc->resid, sc->x, sizeof(float) * n * D);
    be->rmsnorm(sc->x, W->attn_norm, sc->xn, n, D, c->rms_eps);
    be->matmul(sc->xn, W->wq, sc->q, n, qd, D);
    be->matmul(sc->xn, W->wk, sc->k, n, kd, D);
    be->matmul(sc->xn, W->wv, sc->v, n, kd, D);
    if (W->bq) {
        be->add_bias(sc->q, W->bq, n, qd);
        be->add_bias(sc->k, W->bk, n, kd);
        be->add_bias(sc->v, W->bv, n, kd);
    }
    be->rope(sc->q, s->positions, n, (int32_t)H, (int32_t)d, m->rope_inv_freq, c->rope_pairing);
    be->rope(sc->k, s->positions, n, (int32_t)Hkv, (int32_t)d, m->rope_inv_freq, c->rope_pairing);

    KVC_TRY(kvc_cache_reserve(&s->cache, l, n));
    kvc_layer_cache *L = &s->cache.layers[l];
    int64_t past_stack[64];
    int64_t *past = Hkv <= 64 ? past_stack : malloc(sizeof(int64_t) * Hkv);
    if (!past) return kvc_fail(KVC_ERR_NOMEM, "out of memory");
    for (int64_t h = 0; h < Hkv; h++) past[h] = L->len[h];
    kvc_cache_append(&s->cache, l, sc->k, sc->v, s->positions, n);
    be->attention(sc->q, n, (int32_t)H, (int32_t)Hkv, (int32_t)d, (const float *const *)L->k,
                  (const float *const *)L->v, past, 1.0f / sqrtf((float)d), sc->att);
    be->matmul(sc->att, W->wo, sc->o, n, D, qd);

    kvc_status st = KVC_OK;
    if (s->hook) {
        kvc_layer_ctx ctx = {l, n, past, sc->q, sc->att, sc->o, sc->resid};
        st = run_hook(s, &ctx);
    }
    for (int32_t i = 0; st == KVC_OK && i < s->n_followers; i++) st = follower_layer(s->followers[i], l, n, s->positions, sc);
    if (past != past_stack) free(past);
    if (st != KVC_OK) return st;
    be->add(sc->x, sc->o, n * D);

    /* MLP block, in row blocks */
    mlp_block(be, W, c, sc, n);
    return KVC_OK;
}

/* A failed call must lose nothing: drop the rows this call appended to layers 0..failed. A layer a
 * press compacted during the call cannot be restored; then the session is marked and must be reset. */
static void rollback(kvc_session *s, int32_t failed, int64_t n) {
    const int32_t Hkv = s->cache.n_kv;
    for (int32_t l = 0; l <= failed && l < s->cache.n_layers; l++) {
        kvc_layer_cache *L = &s->cache.layers[l];
        for (int32_t h = 0; h < Hkv; h++) {
            /* appended rows carry positions >= s->pos */
            int64_t keep = L->len[h];
            while (keep > 0 && L->pos[h][keep - 1] >= s->pos) keep--;
            if (s->hook && keep != L->len[h] - n && L->len[h] > 0 && l < failed) s->needs_reset = 1;
            L->len[h] = keep;
        }
    }
}

kvc_status kvc_forward(kvc_session *s, const int32_t *ids, int64_t n, int32_t logits_mode, float *logits) {
    if (logits_mode < KVC_LOGITS_NONE || logits_mode > KVC_LOGITS_ALL)
        return kvc_fail(KVC_ERR_ARG, "kvc_forward: logits_mode %d is not 0 (none), 1 (last) or 2 (all)", logits_mode);
    const int64_t row = logits_mode == KVC_LOGITS_NONE ? KVC_ROW_NONE : logits_mode == KVC_LOGITS_ALL ? KVC_ROW_ALL : n - 1;
    return kvc_forward_ex(s, ids, n, NULL, 0, row, logits);
}

kvc_status kvc_forward_ex(kvc_session *s, const int32_t *ids, int64_t n_ids, const float *embeddings, int64_t n_emb,
                          int64_t logits_row, float *logits) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvc_forward: session is NULL");
    if (n_ids < 0 || n_emb < 0) return kvc_fail(KVC_ERR_ARG, "kvc_forward: negative token count");
    const int64_t n = n_ids + n_emb;
    if (n <= 0) return kvc_fail(KVC_ERR_ARG, "kvc_forward: need at least one token (got %lld)", (long long)n);
    if (n_ids > 0 && !ids) return kvc_fail(KVC_ERR_ARG, "kvc_forward: ids is NULL");
    if (n_emb > 0 && !embeddings) return kvc_fail(KVC_ERR_ARG, "kvc_forward: embeddings is NULL");
    if (logits_row < KVC_ROW_ALL || logits_row >= n)
        return kvc_fail(KVC_ERR_ARG, "kvc_forward: logits row %lld outside [0, %lld)", (long long)logits_row, (long long)n);
    if (logits_row != KVC_ROW_NONE && !logits) return kvc_fail(KVC_ERR_ARG, "kvc_forward: logits buffer is NULL");
    if (s->needs_reset)
        return kvc_fail(KVC_ERR_ARG, "this session failed in the middle of a compressed prefill: call reset() first");
    const kvc_model *m = s->model;
    const kvc_config *c = &m->cfg;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return kvc_fail(KVC_ERR_ARG, "token id %d at index %lld is outside the vocabulary [0, %d)", ids[i],
                            (long long)i, c->vocab);
    if (s->dev) return kvc_dev_forward(s, ids, n_ids, embeddings, n_emb, logits_row, logits);
    if (s->pos == 0 && s->capacity_hint > 0) {
        /* preallocate every layer once for the expected sequence length */
        for (int32_t l = 0; l < c->n_layers; l++) KVC_TRY(kvc_cache_reserve(&s->cache, l, s->capacity_hint));
    }
    scratch sc;
    KVC_TRY(scratch_get(s, n, &sc));
    const int64_t D = c->hidden;
    for (int64_t i = 0; i < n; i++) {
        s->positions[i] = s->pos + i;
        const float *src = i < n_ids ? m->tok_embd + (size_t)ids[i] * D : embeddings + (size_t)(i - n_ids) * D;
        memcpy(sc.x + i * D, src, sizeof(float) * D);
    }
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_status st = layer_forward(s, l, n, &sc);
        if (st != KVC_OK) {
            rollback(s, l, n);
            return st;
        }
    }
    s->pos += n;
    if (logits_row == KVC_ROW_NONE) return KVC_OK;
    const int64_t first = logits_row == KVC_ROW_ALL ? 0 : logits_row, rows = logits_row == KVC_ROW_ALL ? n : 1;
    s->be->rmsnorm(sc.x + first * D, m->out_norm, sc.xn, rows, D, c->rms_eps);
    s->be->matmul(sc.xn, m->lm_head, logits, rows, c->vocab, D);
    return KVC_OK;
}

static int cache_is_empty(const kvc_session *s) {
    for (int32_t l = 0; l < s->cache.n_layers; l++)
        for (int32_t h = 0; h < s->cache.n_kv; h++)
            if (kvc_session_cache_len(s, l, h) != 0) return 0;
    return 1;
}

kvc_status kvc_session_copy_cache(kvc_session *dst, const kvc_session *src) {
    if (!dst || !src) return kvc_fail(KVC_ERR_ARG, "kvc_session_copy_cache: session is NULL");
    if (dst == src) return kvc_fail(KVC_ERR_ARG, "copying a session's cache onto itself");
    if (dst->model != src->model) return kvc_fail(KVC_ERR_ARG, "the two sessions belong to different models");
    if (!dst->dev != !src->dev) return kvc_fail(KVC_ERR_ARG, "one session is on the GPU and the other on the CPU");
    if (src->needs_reset) return kvc_fail(KVC_ERR_ARG, "the source session failed a call: reset() it first");
    if (dst->needs_reset || dst->pos != 0 || !cache_is_empty(dst))
        return kvc_fail(KVC_ERR_ARG, "the destination session is not empty: call reset() on it first");
    KVC_TRY(dst->dev ? kvc_dev_copy_cache(dst, src) : kvc_cache_copy(&dst->cache, &src->cache));
    dst->pos = src->pos;
    return KVC_OK;
}

kvc_status kvc_forward_shared(kvc_session *s, kvc_session *const *followers, int32_t n_followers,
                              const int32_t *ids, int64_t n, int64_t logits_row, float *logits) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvc_forward_shared: session is NULL");
    if (n_followers < 0 || (n_followers > 0 && !followers))
        return kvc_fail(KVC_ERR_ARG, "kvc_forward_shared: bad follower list");
    if (!cache_is_empty(s) || s->pos != 0)
        return kvc_fail(KVC_ERR_ARG, "a shared prefill starts from an empty session: call reset() on the leader first");
    if (s->cache.n_kv > 64) return kvc_fail(KVC_ERR_ARG, "kvc_forward_shared supports at most 64 KV heads");
    for (int32_t i = 0; i < n_followers; i++) {
        kvc_session *f = followers[i];
        if (!f || f == s) return kvc_fail(KVC_ERR_ARG, "follower %d is NULL or the leader itself", i);
        if (f->model != s->model) return kvc_fail(KVC_ERR_ARG, "follower %d belongs to another model", i);
        if (f->needs_reset || f->pos != 0 || !cache_is_empty(f))
            return kvc_fail(KVC_ERR_ARG, "follower %d is not empty: call reset() on it first", i);
        for (int32_t j = 0; j < i; j++)
            if (followers[j] == f) return kvc_fail(KVC_ERR_ARG, "follower %d is listed twice", i);
    }
    s->followers = followers;
    s->n_followers = n_followers;
    kvc_status st = kvc_forward_ex(s, ids, n, NULL, 0, logits_row, logits);
    s->followers = NULL;
    s->n_followers = 0;
    for (int32_t i = 0; i < n_followers; i++) {
        if (st == KVC_OK) {
            followers[i]->pos = s->pos;
        } else {
            /* a follower may hold a partial prefill: empty it, the caller starts again */
            kvc_session_reset(followers[i]);
        }
    }
    return st;
}

/* ---- batched decode: one new token for each of B sessions ------------------------------------------
 * The weight GEMMs run once on B rows (decode is bound by reading the weights, so B sessions cost
 * little more than one); attention runs per session over its own ragged cache. Sessions may hold
 * different caches (one per press, say) and sit at different positions. */
static kvc_status batch_layer(kvc_session *const *ss, int32_t B, int32_t l, scratch *sc, const int64_t *positions) {
    kvc_session *s0 = ss[0];
    const kvc_model *m = s0->model;
    const kvc_config *c = &m->cfg;
    const kvc_backend *be = s0->be;
    const kvc_layer_weights *W = &m->layers[l];
    const int64_t D = c->hidden, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t qd = H * d, kd = Hkv * d;

    be->rmsnorm(sc->x, W->attn_norm, sc->xn, B, D, c->rms_eps);
    be->matmul(sc->xn, W->wq, sc->q, B, qd, D);
    be->matmul(sc->xn, W->wk, sc->k, B, kd, D);
    be->matmul(sc->xn, W->wv, sc->v, B, kd, D);
    if (W->bq) {
        be->add_bias(sc->q, W->bq, B, qd);
        be->add_bias(sc->k, W->bk, B, kd);
        be->add_bias(sc->v, W->bv, B, kd);
    }
    be->rope(sc->q, positions, B, (int32_t)H, (int32_t)d, m->rope_inv_freq, c->rope_pairing);
    be->rope(sc->k, positions, B, (int32_t)Hkv, (int32_t)d, m->rope_inv_freq, c->rope_pairing);
    for (int32_t i = 0; i < B; i++) {
        kvc_session *s = ss[i];
        KVC_TRY(kvc_cache_reserve(&s->cache, l, 1));
        kvc_layer_cache *L = &s->cache.layers[l];
        int64_t past[64];
        for (int64_t h = 0; h < Hkv; h++) past[h] = L->len[h];
        kvc_cache_append(&s->cache, l, sc->k + i * kd, sc->v + i * kd, positions + i, 1);
        be->attention(sc->q + i * qd, 1, (int32_t)H, (int32_t)Hkv, (int32_t)d, (const float *const *)L->k,
                      (const float *const *)L->v, past, 1.0f / sqrtf((float)d), sc->att + i * qd);
    }
    be->matmul(sc->att, W->wo, sc->o, B, D, qd);
    be->add(sc->x, sc->o, B * D);
    mlp_block(be, W, c, sc, B);
    return KVC_OK;
}

kvc_status kvc_forward_batch(kvc_session *const *ss, int32_t B, const int32_t *ids, float *logits) {
    if (B <= 0 || !ss || !ids) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: need B >= 1 sessions and ids");
    if (!logits) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: logits buffer is NULL");
    kvc_session *s0 = ss[0];
    if (!s0) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: session 0 is NULL");
    const kvc_config *c = &s0->model->cfg;
    if (c->n_kv_heads > 64) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch supports at most 64 KV heads");
    for (int32_t i = 0; i < B; i++) {
        const kvc_session *s = ss[i];
        if (!s) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: session %d is NULL", i);
        if (s->model != s0->model) return kvc_fail(KVC_ERR_ARG, "session %d belongs to another model", i);
        if (s->needs_reset)
            return kvc_fail(KVC_ERR_ARG, "session %d failed in the middle of a compressed prefill: reset it", i);
        if (s->hook) return kvc_fail(KVC_ERR_ARG, "session %d has a press attached: detach it before batched decoding", i);
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return kvc_fail(KVC_ERR_ARG, "token id %d for session %d is outside the vocabulary [0, %d)", ids[i], i, c->vocab);
        for (int32_t j = 0; j < i; j++)
            if (ss[j] == s) return kvc_fail(KVC_ERR_ARG, "session %d is listed twice", i);
    }
    if (s0->dev) return kvc_dev_forward_batch(ss, B, ids, logits);
    scratch sc;
    KVC_TRY(scratch_get(s0, B, &sc));
    int64_t *positions = s0->positions; /* sized for B by scratch_get */
    const int64_t D = c->hidden;
    for (int32_t i = 0; i < B; i++) {
        positions[i] = ss[i]->pos;
        memcpy(sc.x + i * D, s0->model->tok_embd + (size_t)ids[i] * D, sizeof(float) * D);
    }
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_status st = batch_layer(ss, B, l, &sc, positions);
        if (st != KVC_OK) {
            /* lose nothing: drop the row this call appended to layers 0..l of every session */
            for (int32_t i = 0; i < B; i++)
                for (int32_t k = 0; k <= l; k++) {
                    kvc_layer_cache *L = &ss[i]->cache.layers[k];
                    for (int32_t h = 0; h < ss[i]->cache.n_kv; h++)
                        if (L->len[h] > 0 && L->pos[h][L->len[h] - 1] == positions[i]) L->len[h]--;
                }
            return st;
        }
    }
    for (int32_t i = 0; i < B; i++) ss[i]->pos += 1;
    s0->be->rmsnorm(sc.x, s0->model->out_norm, sc.xn, B, D, c->rms_eps);
    s0->be->matmul(sc.xn, s0->model->lm_head, logits, B, c->vocab, D);
    return KVC_OK;
}
