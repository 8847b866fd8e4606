/* The decoder forward pass, written once for every backend: embeddings, N x (RMSNorm, attention over
 * the ragged cache, SwiGLU MLP), final norm, logits. Prefill is batched (all new tokens at once through
 * every GEMM); the MLP runs in row blocks so gate|up stays O(block x ffn) whatever the prompt length.
 *
 * One layer, on the backend's kernels (core/backend.h):
 *   xn = rmsnorm(x); qkv = xn Wqkv^T (+ b); [qwen3: RMSNorm of each q and k head]; RoPE on q and k (LongRoPE:
 *   the long factors' frequencies in a call that reaches past the original context, as transformers does);
 *   K/V appended to the cache; attention (within the sliding window, in window layers);
 *   o = att Wo^T; [the attached presses' hooks (core/press_i.h): one may compact the layer];
 *   x += o and xn = rmsnorm(x) (one kernel);
 *   per row block: gu = xn Wgu^T; gu = silu(gate) * up (Gemma: gelu_tanh(gate) * up); x += gu Wdown^T
 *   (a mixture-of-experts layer: its experts instead, engine/moe.c).
 * Gemma 3 also: embeddings times sqrt(D); the attention output and the MLP output each RMS-normed before
 * their residual add; the sliding layers (every one but each window_period-th) on their own RoPE base. Gemma 2
 * the same on one RoPE base, its attention scores soft-capped inside the backend's attention and its logits
 * soft-capped where they land on the host (kvc_softcap).
 * The same layer serves the prefill and the decode step of one session, a shared prefill (followers
 * receive each layer's K/V rows), a batched decode (one token of each of B sessions: the weight GEMMs run
 * once on B rows, attention per session over its own cache) and the decode step replayed as a graph. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "session.h"

#define LOGIT_ROWS 64 /* rows of logits per chunk: a bounded buffer whatever the rows asked for */

/* ---- activations ------------------------------------------------------------------------------------ */

static void act_release(kvc_session *s) {
    kvc_act *a = &s->act;
    kvc_buf **bufs[] = {&a->x, &a->xn, &a->qkv, &a->att, &a->o, &a->gu, &a->logits, &a->ids, &a->pos, &a->win};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (*bufs[i]) s->be->free(*bufs[i]);
        *bufs[i] = NULL;
    }
    kvc_moe_release(s);
    a->rows = a->logit_rows = 0;
    a->generation++;
}

void kvc_act_free(kvc_session *s) { act_release(s); }

static kvc_status grow(kvc_session *s, kvc_buf **b, int32_t dtype, int64_t n, const char *what) {
    if (*b) s->be->free(*b);
    *b = NULL;
    return s->be->alloc(dtype, n, KVC_MEM_ACT, what, b);
}

kvc_status kvc_act_reserve(kvc_session *s, int64_t n, int64_t logit_rows) {
    kvc_act *a = &s->act;
    if (n <= a->rows && logit_rows <= a->logit_rows) return KVC_OK;
    const kvc_config *c = &s->model->cfg;
    const int64_t D = c->hidden, qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    const int32_t t = s->be->act_dtype;
    kvc_status st = KVC_OK;
    a->generation++;
    if (n > a->rows) {
        const int64_t blk = n < s->be->mlp_rows ? n : s->be->mlp_rows;
        a->rows = 0;
        if (st == KVC_OK) st = grow(s, &a->x, KVC_F32, n * D, "activations (residual)");
        if (st == KVC_OK) st = grow(s, &a->xn, t, n * D, "activations (norm)");
        if (st == KVC_OK) st = grow(s, &a->qkv, t, n * (qd + 2 * kd), "activations (q|k|v)");
        if (st == KVC_OK) st = grow(s, &a->att, t, n * qd, "activations (attention)");
        if (st == KVC_OK) st = grow(s, &a->o, t, n * D, "activations (o)");
        if (st == KVC_OK) st = grow(s, &a->gu, t, blk * 2 * c->ffn, "activations (gate|up)");
        if (st == KVC_OK) st = grow(s, &a->ids, KVC_I32, n, "token ids");
        if (st == KVC_OK) st = grow(s, &a->pos, KVC_I64, n, "positions");
        if (st == KVC_OK && c->sliding_window > 0)
            st = grow(s, &a->win, KVC_I64, (n > c->n_layers ? n : c->n_layers) * c->n_kv_heads, "sliding-window starts");
        if (st == KVC_OK) st = kvc_moe_reserve(s, n); /* engine/moe.c: models with experts only */
        if (st == KVC_OK) a->rows = n;
    }
    if (st == KVC_OK && logit_rows > a->logit_rows) {
        a->logit_rows = 0;
        st = grow(s, &a->logits, KVC_F32, logit_rows * c->vocab, "logits");
        if (st == KVC_OK) a->logit_rows = logit_rows;
    }
    if (st != KVC_OK) act_release(s); /* a call too long for the device: give back what it grabbed */
    return st;
}

kvc_status kvc_positions_reserve(kvc_session *s, int64_t n) {
    const kvc_config *c = &s->model->cfg;
    if (c->sliding_window > 0) { /* window starts: n rows, or one row in every layer (a decode graph) */
        const size_t need = (size_t)(n > c->n_layers ? n : c->n_layers) * (size_t)c->n_kv_heads;
        if (need > s->win_cap) {
            int64_t *w = realloc(s->win, sizeof(int64_t) * need);
            if (!w) return kvc_fail(KVC_ERR_NOMEM, "out of memory: sliding-window starts");
            s->win = w;
            s->win_cap = need;
        }
    }
    if ((size_t)n <= s->positions_cap) return KVC_OK;
    int64_t *p = realloc(s->positions, sizeof(int64_t) * (size_t)n);
    if (!p) return kvc_fail(KVC_ERR_NOMEM, "out of memory: positions");
    s->positions = p;
    s->positions_cap = (size_t)n;
    return KVC_OK;
}

/* ---- sliding window ---------------------------------------------------------------------------------- */

static int windowed(const kvc_config *c, int32_t l) { return kvc_layer_slides(c, l); }

/* For n new rows at positions p0 .. p0 + n - 1 about to be appended to layer cache L: the first row query
 * i of head h sees, out[i * Hkv + h]. Query i sees the positions > p0 + i - W: among the rows held (their
 * positions increase), those from the lower bound of p0 + i - W + 1; once none is left (i >= W - 1), also
 * the first i - W + 1 new rows drop out. Nondecreasing in i, so one pass per head. */
static void window_starts(const kvc_layer_cache *L, int32_t Hkv, int64_t p0, int64_t n, int64_t W, int64_t *out) {
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t *pos = L->pos[h], len = L->len[h];
        int64_t j = 0;
        for (int64_t i = 0; i < n; i++) {
            while (j < len && pos[j] <= p0 + i - W) j++;
            out[i * Hkv + h] = j + (i - W + 1 > 0 ? i - W + 1 : 0);
        }
    }
}

/* A decode graph replays every layer at once: the starts of the step's one row in every layer, uploaded
 * before the launch (row l of act.win for layer l). */
static kvc_status window_starts_all_layers(kvc_session *s) {
    const kvc_config *c = &s->model->cfg;
    if (c->sliding_window <= 0) return KVC_OK;
    for (int32_t l = 0; l < c->n_layers; l++)
        if (windowed(c, l)) window_starts(&s->cache.layers[l], c->n_kv_heads, s->pos, 1, c->sliding_window, s->win + l * c->n_kv_heads);
    return s->be->upload(kvc_view_of(s->act.win, 0, c->n_kv_heads), c->n_layers, c->n_kv_heads, s->win, KVC_I64);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The attached presses' hooks after a layer's attention, each timed: a press's own cost, apart from the
 * forward it rides on (benchmarks). on_layer runs in multi-token calls (followers too); on_decode_layer in
 * every call after the session's first. */
static int has_layer_hook(const kvc_session *s) {
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt && s->slots[i].vt->on_layer) return 1;
    return 0;
}

static int decode_hooks_active(const kvc_session *s) {
    if (s->pos <= 0) return 0;
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt && s->slots[i].vt->on_decode_layer) return 1;
    return 0;
}

/* A press whose decode steps work on the host between layers: its steps run eagerly (no graph). */
static int eager_decode(const kvc_session *s) {
    for (int32_t i = 0; i < KVC_N_SLOTS; i++)
        if (s->slots[i].vt && (s->slots[i].vt->traits & KVC_PRESS_EAGER_DECODE)) return 1;
    return 0;
}

/* A press's hooks skip the layers the model does not press (Gemma 3's sliding ones, kvc_layer_pressed); a
 * probe's (KVC_PRESS_EVERY_LAYER: a measurement over the whole cache) see every layer. */
static kvc_status run_hooks(kvc_session *s, const kvc_layer_ctx *ctx, int decode) {
    const int pressed = kvc_layer_pressed(&s->model->cfg, ctx->layer);
    for (int32_t i = 0; i < KVC_N_SLOTS; i++) {
        const kvc_press_slot *slot = &s->slots[i];
        kvc_status (*fn)(void *, kvc_session *, const kvc_layer_ctx *) =
            !slot->vt ? NULL : decode ? slot->vt->on_decode_layer : slot->vt->on_layer;
        if (!fn || (!pressed && !(slot->vt->traits & KVC_PRESS_EVERY_LAYER))) continue;
        const double t0 = now_seconds();
        const kvc_status st = fn(slot->self, s, ctx);
        s->press_seconds += now_seconds() - t0;
        if (st != KVC_OK) return st;
    }
    return KVC_OK;
}

static kvc_status run_prefill_hooks(kvc_session *s, const kvc_layer_ctx *ctx) { return run_hooks(s, ctx, 0); }

/* ---- the layer --------------------------------------------------------------------------------------- */

/* The attention block up to the hook point for B sessions of n rows each (consecutive rows of the lead
 * session's activations): norm, q|k|v, RoPE, each session's K/V append and attention over its own
 * cache, o projection. body: the replayable decode body of a graph (no host bookkeeping; the caller
 * reserved the room). past (B == 1): receives the lengths before the append. */
static kvc_status attention_block(kvc_session *lead, kvc_session *const *ss, int32_t B, int32_t l, int64_t n, int body,
                                  int64_t *past) {
    const kvc_model *m = lead->model;
    const kvc_config *c = &m->cfg;
    const kvc_backend *be = lead->be;
    const kvc_layer_weights *W = &m->layers[l];
    const int64_t D = c->hidden, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t qd = H * d, kd = Hkv * d, ldq = qd + 2 * kd, rows = B * n;
    const kvc_view x = kvc_view_of(lead->act.x, 0, D), xn = kvc_view_of(lead->act.xn, 0, D);
    const kvc_view qkv = kvc_view_of(lead->act.qkv, 0, ldq), att = kvc_view_of(lead->act.att, 0, qd);
    const kvc_view pos = kvc_view_of(lead->act.pos, 0, 1);
    KVC_TRY(be->rmsnorm(x, NULL, W->attn_norm, xn, rows, D, c->rms_eps));
    KVC_TRY(kvc_wgroup_matmul(be, xn, &W->qkv, qkv, rows, D));
    if (W->bqkv.buf) KVC_TRY(be->add_bias(qkv, W->bqkv, rows, ldq));
    if (W->q_norm.buf) { /* qwen3: each head of q and k normalised before RoPE */
        KVC_TRY(be->head_rmsnorm(qkv, 0, rows, (int32_t)H, (int32_t)d, W->q_norm, c->rms_eps));
        KVC_TRY(be->head_rmsnorm(qkv, qd, rows, (int32_t)Hkv, (int32_t)d, W->k_norm, c->rms_eps));
    }
    if (be->hint_weights) { /* what this layer reads after its attention */
        const kvc_view next[2] = {W->wo, W->gu.whole};
        be->hint_weights(next, 2);
    }
    int64_t end = 0; /* the last position + 1 of the call (of the batch's sessions) */
    for (int32_t i = 0; i < B; i++)
        if (ss[i]->pos + n > end) end = ss[i]->pos + n;
    const kvc_rope_rule rope = kvc_model_rope(m, l, end); /* LongRoPE's factors, Gemma 3's local base */
    KVC_TRY(be->rope(qkv, 0, rows, (int32_t)H, (int32_t)d, pos, rope.freq, c->rope_pairing, rope.mscale));
    KVC_TRY(be->rope(qkv, qd, rows, (int32_t)Hkv, (int32_t)d, pos, rope.freq, c->rope_pairing, rope.mscale));
    for (int32_t i = 0; i < B; i++) {
        kvc_session *si = ss[i];
        kvc_layer_cache *L = &si->cache.layers[l];
        const kvc_view mine = kvc_view_at(qkv, i * n, 0);
        /* a graph's starts were uploaded for every layer before the launch; otherwise this session's, now */
        kvc_view start = {0};
        if (windowed(c, l)) start = kvc_view_of(lead->act.win, (body ? l : i * n) * Hkv, Hkv);
        if (body) {
            KVC_TRY(be->kv_append(L->kv, mine, qd, qd + kd, n));
        } else {
            if (start.buf) {
                window_starts(L, (int32_t)Hkv, lead->positions[i * n], n, c->sliding_window, lead->win);
                KVC_TRY(be->upload(start, n, Hkv, lead->win, KVC_I64));
            }
            KVC_TRY(kvc_cache_reserve(&si->cache, l, n));
            if (past) memcpy(past, L->len, sizeof(int64_t) * (size_t)Hkv);
            KVC_TRY(kvc_cache_append(&si->cache, l, mine, qd, qd + kd, lead->positions + i * n, n));
        }
        KVC_TRY(be->attention(mine, n, (int32_t)H, L->kv, kvc_attn_scale(c), c->attn_softcap, start, kvc_view_at(att, i * n, 0),
                              0));
        /* the call's rows, read exact by its own queries, go into the cache's type */
        KVC_TRY(body ? be->kv_commit(L->kv) : kvc_cache_commit(&si->cache, l));
    }
    return be->matmul(att, W->wo, kvc_view_of(lead->act.o, 0, D), rows, D, qd, 0);
}

/* x += o, fused into the MLP norm; then the MLP in row blocks, the down projection added into x.
 * Gemma (post_norms): o is normed before the add (after the hooks, which see the projection's output as
 * kvpress's do), and the MLP's output goes to o, is normed, then added: the add is the backend's fused
 * residual add of rmsnorm, whose normed copy in xn is not used (the next step normalises x itself). */
static kvc_status mlp_block(kvc_session *s, int32_t l, int64_t rows) {
    const kvc_config *c = &s->model->cfg;
    const kvc_backend *be = s->be;
    const kvc_layer_weights *W = &s->model->layers[l];
    const int64_t D = c->hidden, F = c->ffn;
    const kvc_view x = kvc_view_of(s->act.x, 0, D), xn = kvc_view_of(s->act.xn, 0, D), o = kvc_view_of(s->act.o, 0, D);
    const kvc_view gu = kvc_view_of(s->act.gu, 0, 2 * F);
    if (c->post_norms) KVC_TRY(be->head_rmsnorm(o, 0, rows, 1, (int32_t)D, W->post_attn_norm, c->rms_eps));
    KVC_TRY(be->rmsnorm(x, &o, W->ffn_norm, xn, rows, D, c->rms_eps));
    if (kvc_layer_moe(c, l)) return kvc_moe_mlp(s, l, rows); /* engine/moe.c (experts are plain SwiGLU MLPs) */
    for (int64_t r0 = 0; r0 < rows; r0 += be->mlp_rows) {
        const int64_t nr = rows - r0 < be->mlp_rows ? rows - r0 : be->mlp_rows;
        KVC_TRY(kvc_wgroup_matmul(be, kvc_view_at(xn, r0, 0), &W->gu, gu, nr, D));
        KVC_TRY(c->mlp_act == KVC_MLP_GELU_TANH ? be->geglu(gu, nr, F) : be->swiglu(gu, nr, F));
        KVC_TRY(be->matmul(gu, W->wdown, kvc_view_at(c->post_norms ? o : x, r0, 0), nr, D, F, !c->post_norms));
    }
    if (!c->post_norms) return KVC_OK;
    KVC_TRY(be->head_rmsnorm(o, 0, rows, 1, (int32_t)D, W->post_ffn_norm, c->rms_eps));
    return be->rmsnorm(x, &o, W->post_ffn_norm, xn, rows, D, c->rms_eps);
}

/* Token embeddings into rows [0, n) of x, times the model's embedding scale (Gemma). */
static kvc_status embed_rows(kvc_session *s, int64_t n) {
    const kvc_config *c = &s->model->cfg;
    const kvc_view x = kvc_view_of(s->act.x, 0, c->hidden);
    KVC_TRY(s->be->embed(s->model->tok_embd, kvc_view_of(s->act.ids, 0, 1), n, c->hidden, x));
    return c->embed_scale > 0 ? s->be->scale(x, n, c->hidden, c->embed_scale) : KVC_OK;
}

static kvc_layer_ctx layer_ctx(const kvc_session *s, int32_t l, int64_t n, const int64_t *past) {
    const kvc_config *c = &s->model->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, ldq = qd + 2 * (int64_t)c->n_kv_heads * c->head_dim;
    kvc_layer_ctx ctx = {l, n, past, kvc_view_of(s->act.qkv, 0, ldq), kvc_view_of(s->act.att, 0, qd),
                         kvc_view_of(s->act.o, 0, c->hidden), kvc_view_of(s->act.x, 0, c->hidden), s->positions,
                         kvc_view_of(s->act.xn, 0, c->hidden)};
    return ctx;
}

/* A follower of a shared forward (kvc_forward_shared) receives this layer's new K/V rows into its own
 * cache and lets its own hook act, as if it had computed the layer itself: a press acts after the
 * layer's attention, so the hidden states of the leader and of every follower are the same. */
static kvc_status follower_layer(kvc_session *f, const kvc_session *lead, int32_t l, int64_t n) {
    const kvc_config *c = &lead->model->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t past[KVC_MAX_KV_HEADS];
    KVC_TRY(kvc_cache_reserve(&f->cache, l, n));
    memcpy(past, f->cache.layers[l].len, sizeof(int64_t) * (size_t)c->n_kv_heads);
    KVC_TRY(kvc_cache_append(&f->cache, l, kvc_view_of(lead->act.qkv, 0, qd + 2 * kd), qd, qd + kd, lead->positions, n));
    KVC_TRY(kvc_cache_commit(&f->cache, l)); /* as the leader's rows after its attention */
    if (!has_layer_hook(f) || n <= 1) return KVC_OK;
    const kvc_layer_ctx ctx = layer_ctx(lead, l, n, past);
    return run_hooks(f, &ctx, 0);
}

/* One layer of one session's call on n rows: the attention block, the hooks, the MLP. */
static kvc_status layer_forward(kvc_session *s, int32_t l, int64_t n) {
    int64_t past[KVC_MAX_KV_HEADS];
    KVC_TRY(attention_block(s, &s, 1, l, n, 0, past));
    const int prefill = n > 1 && has_layer_hook(s), decode = decode_hooks_active(s);
    if (prefill || decode) {
        const kvc_layer_ctx ctx = layer_ctx(s, l, n, past);
        if (prefill) KVC_TRY(kvc_scoped_hooks(s, &ctx, run_prefill_hooks)); /* the press scope: press_scope.c */
        if (decode) KVC_TRY(run_hooks(s, &ctx, 1));
    }
    for (int32_t i = 0; i < s->n_followers; i++) KVC_TRY(follower_layer(s->followers[i], s, l, n));
    return mlp_block(s, l, n);
}

/* ---- logits ------------------------------------------------------------------------------------------ */

static kvc_status logits_kernels(kvc_session *s, int64_t first, int64_t rows) {
    const kvc_model *m = s->model;
    const int64_t D = m->cfg.hidden;
    KVC_TRY(s->be->rmsnorm(kvc_view_of(s->act.x, first * D, D), NULL, m->out_norm, kvc_view_of(s->act.xn, 0, D), rows, D,
                           m->cfg.rms_eps));
    return s->be->matmul(kvc_view_of(s->act.xn, 0, D), m->lm_head, kvc_view_of(s->act.logits, 0, m->cfg.vocab), rows,
                         m->cfg.vocab, D, 0);
}

/* The first `rows` rows of the logits buffer into dst, soft-capped where the model caps them (Gemma 2's
 * final_logit_softcapping: on the host, where every logit lands). */
static kvc_status logits_download(kvc_session *s, int64_t rows, float *dst) {
    const int64_t V = s->model->cfg.vocab;
    const float cap = s->model->cfg.logit_softcap;
    KVC_TRY(s->be->download(kvc_view_of(s->act.logits, 0, V), rows, V, dst, KVC_F32));
    if (cap > 0)
        for (int64_t i = 0; i < rows * V; i++) dst[i] = kvc_softcap(dst[i], cap);
    return KVC_OK;
}

/* Logits of rows [first, first + rows) of the residual stream into dst [rows, vocab], a chunk at a time. */
static kvc_status logits_out(kvc_session *s, int64_t first, int64_t rows, float *dst) {
    const int64_t V = s->model->cfg.vocab;
    for (int64_t r0 = 0; r0 < rows; r0 += LOGIT_ROWS) {
        const int64_t nr = rows - r0 < LOGIT_ROWS ? rows - r0 : LOGIT_ROWS;
        KVC_TRY(logits_kernels(s, first + r0, nr));
        KVC_TRY(logits_download(s, nr, dst + r0 * V));
    }
    return KVC_OK;
}

/* ---- inputs ------------------------------------------------------------------------------------------- */

/* Positions pos0.. of n rows and their inputs (n_ids token ids, then embedding rows) into the activations. */
static kvc_status inputs(kvc_session *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb) {
    const int64_t n = n_ids + n_emb, D = s->model->cfg.hidden;
    for (int64_t i = 0; i < n; i++) s->positions[i] = s->pos + i;
    KVC_TRY(s->be->upload(kvc_view_of(s->act.pos, 0, n), 1, n, s->positions, KVC_I64));
    if (n_ids > 0) {
        KVC_TRY(s->be->upload(kvc_view_of(s->act.ids, 0, n_ids), 1, n_ids, ids, KVC_I32));
        KVC_TRY(embed_rows(s, n_ids));
    }
    if (n_emb > 0) KVC_TRY(s->be->upload(kvc_view_of(s->act.x, n_ids * D, D), n_emb, D, emb, KVC_F32));
    return KVC_OK;
}

/* Wait for the call's device work (asynchronous faults surface here, in the call that caused them). */
static kvc_status end_of_call(const kvc_backend *be) { return be->sync ? be->sync() : KVC_OK; }

/* ---- the decode step as a graph ------------------------------------------------------------------------
 * One token, no follower: everything after the host's bookkeeping (room in every layer, the token id
 * and position uploaded) is device work that reads its inputs from buffers, so one captured graph
 * replays every step. The first step after a capture is needed runs eagerly (first launches load
 * kernels and libraries outside the capture); a graph is captured again when the activations it holds
 * were replaced, or when the backend says its own scratch moved. */

static kvc_status decode_body(void *user) {
    kvc_session *s = user;
    KVC_TRY(embed_rows(s, 1));
    for (int32_t l = 0; l < s->model->cfg.n_layers; l++) {
        KVC_TRY(attention_block(s, &s, 1, l, 1, 1, NULL));
        KVC_TRY(mlp_block(s, l, 1));
    }
    return logits_kernels(s, 0, 1);
}

static void graph_failed(kvc_session *s, const char *what) {
    snprintf(s->graph_error, sizeof s->graph_error, "%s: %s", what, kvc_last_error());
    s->graphs = 0; /* eager from now on; graph_error says why (kvc_session_graph_info) */
}

/* 1: the step ran as a graph (*st its status); 0: run it eagerly. */
static int decode_graph(kvc_session *s, const int32_t *id, int64_t logits_row, float *logits, kvc_status *st) {
    const kvc_backend *be = s->be;
    const kvc_config *c = &s->model->cfg;
    const int stale = !s->graph || s->graph_generation != s->act.generation || s->graph_rope_long != kvc_rope_long(c, s->pos + 1);
    if (stale && s->decodes_since_capture == 0) {
        s->decodes_since_capture = 1; /* the warm-up step */
        return 0;
    }
    if ((*st = kvc_act_reserve(s, 1, 1)) != KVC_OK || (*st = kvc_positions_reserve(s, 1)) != KVC_OK) return 1;
    for (int32_t l = 0; l < c->n_layers; l++)
        if ((*st = kvc_cache_reserve(&s->cache, l, 1)) != KVC_OK) return 1;
    if ((*st = inputs(s, id, 1, NULL, 0)) != KVC_OK || (*st = window_starts_all_layers(s)) != KVC_OK) return 1;
    if (stale || s->graph_generation != s->act.generation) {
        if (be->graph_capture(&s->graph, decode_body, s) != KVC_OK) {
            graph_failed(s, "decode graph capture");
            return 0;
        }
        s->graph_generation = s->act.generation;
        s->graph_rope_long = kvc_rope_long(c, s->pos + 1);
        s->decodes_since_capture = 0; /* the next capture (activations replaced) gets its eager step too */
    }
    kvc_status g = be->graph_launch(s->graph);
    if (g == KVC_ERR_UNSUPPORTED) { /* the backend's scratch moved: capture again */
        if (be->graph_capture(&s->graph, decode_body, s) != KVC_OK) {
            graph_failed(s, "decode graph capture");
            return 0;
        }
        g = be->graph_launch(s->graph);
    }
    if (g != KVC_OK) {
        /* lose nothing: the device lengths follow the host's again */
        for (int32_t l = 0; l < c->n_layers; l++) be->kv_set_lens(s->cache.layers[l].kv, s->cache.layers[l].len);
        *st = g;
        return 1;
    }
    *st = logits_row == KVC_ROW_NONE ? end_of_call(be) : logits_download(s, 1, logits);
    if (*st != KVC_OK) {
        for (int32_t l = 0; l < c->n_layers; l++) be->kv_set_lens(s->cache.layers[l].kv, s->cache.layers[l].len);
        return 1;
    }
    for (int32_t l = 0; l < c->n_layers; l++) kvc_cache_note_append(&s->cache, l, s->positions, 1);
    s->pos += 1;
    s->graph_steps++;
    *st = KVC_OK;
    return 1;
}

/* ---- the forward call ------------------------------------------------------------------------------------ */

/* A failed call loses nothing: the rows it appended to layers 0 .. l go. Rows a press evicted cannot come
 * back, so a session whose cache was compacted must be reset (followers are reset by the shared call). */
static kvc_status roll_back(kvc_session *s, int32_t l, uint64_t compactions_before, kvc_status st) {
    kvc_cache_drop_from(&s->cache, l, s->pos);
    for (int32_t i = 0; i < s->n_followers; i++) kvc_cache_drop_from(&s->followers[i]->cache, l, s->pos);
    if (s->cache.compactions != compactions_before) s->needs_reset = 1;
    return st;
}

static kvc_status forward_locked(kvc_session *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb,
                                 int64_t logits_row, float *logits) {
    const kvc_config *c = &s->model->cfg;
    const int64_t n = n_ids + n_emb;
    if (s->pos == 0 && s->capacity_hint > 0) /* preallocate every layer once for the announced sequence length */
        for (int32_t l = 0; l < c->n_layers; l++) KVC_TRY(kvc_cache_reserve(&s->cache, l, s->capacity_hint));
    if (s->graphs && s->be->graph_capture && n_ids == 1 && n_emb == 0 && s->n_followers == 0 && !eager_decode(s)) {
        kvc_status st;
        if (decode_graph(s, ids, logits_row, logits, &st)) return st;
    }
    const int64_t lrows = logits_row == KVC_ROW_NONE ? 0 : logits_row == KVC_ROW_ALL ? n : 1;
    KVC_TRY(kvc_act_reserve(s, n, lrows < LOGIT_ROWS ? lrows : LOGIT_ROWS));
    KVC_TRY(kvc_positions_reserve(s, n));
    KVC_TRY(inputs(s, ids, n_ids, emb, n_emb));
    const uint64_t before = s->cache.compactions;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_status st = layer_forward(s, l, n);
        if (st != KVC_OK) return roll_back(s, l, before, st);
    }
    /* the rows are committed only once the logits are out (or the device says the work went through) */
    kvc_status st = logits_row == KVC_ROW_NONE ? end_of_call(s->be)
                                                : logits_out(s, logits_row == KVC_ROW_ALL ? 0 : logits_row, lrows, logits);
    if (st != KVC_OK) return roll_back(s, c->n_layers - 1, before, st);
    s->pos += n;
    if (n == 1) s->decodes_since_capture++;
    return KVC_OK;
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
    const kvc_config *c = &s->model->cfg;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return kvc_fail(KVC_ERR_ARG, "token id %d at index %lld is outside the vocabulary [0, %d)", ids[i],
                            (long long)i, c->vocab);
    kvc_backend_lock(s->be);
    kvc_status st = forward_locked(s, ids, n_ids, embeddings, n_emb, logits_row, logits);
    kvc_backend_unlock(s->be);
    return st;
}

kvc_status kvc_forward_shared(kvc_session *s, kvc_session *const *followers, int32_t n_followers, const int32_t *ids,
                              int64_t n, int64_t logits_row, float *logits) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvc_forward_shared: session is NULL");
    if (n_followers < 0 || (n_followers > 0 && !followers))
        return kvc_fail(KVC_ERR_ARG, "kvc_forward_shared: bad follower list");
    if (!kvc_cache_is_empty(&s->cache) || s->pos != 0)
        return kvc_fail(KVC_ERR_ARG, "a shared prefill starts from an empty session: call reset() on the leader first");
    for (int32_t i = 0; i < n_followers; i++) {
        kvc_session *f = followers[i];
        if (!f || f == s) return kvc_fail(KVC_ERR_ARG, "follower %d is NULL or the leader itself", i);
        if (f->model != s->model) return kvc_fail(KVC_ERR_ARG, "follower %d belongs to another model", i);
        if (f->needs_reset || f->pos != 0 || !kvc_cache_is_empty(&f->cache))
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
        if (st == KVC_OK) followers[i]->pos = s->pos;
        else kvc_session_reset(followers[i]); /* a follower may hold a partial prefill: the caller starts again */
    }
    return st;
}

/* ---- batched decode: one new token for each of B sessions ---------------------------------------------- */

static kvc_status batch_locked(kvc_session *const *ss, int32_t B, const int32_t *ids, float *logits) {
    kvc_session *s0 = ss[0];
    const kvc_config *c = &s0->model->cfg;
    KVC_TRY(kvc_act_reserve(s0, B, B < LOGIT_ROWS ? B : LOGIT_ROWS));
    KVC_TRY(kvc_positions_reserve(s0, B));
    for (int32_t i = 0; i < B; i++) s0->positions[i] = ss[i]->pos;
    KVC_TRY(s0->be->upload(kvc_view_of(s0->act.pos, 0, B), 1, B, s0->positions, KVC_I64));
    KVC_TRY(s0->be->upload(kvc_view_of(s0->act.ids, 0, B), 1, B, ids, KVC_I32));
    KVC_TRY(embed_rows(s0, B));
    uint64_t *before = malloc(sizeof(uint64_t) * (size_t)B);
    if (!before) return kvc_fail(KVC_ERR_NOMEM, "out of memory: batched decode");
    for (int32_t i = 0; i < B; i++) before[i] = ss[i]->cache.compactions;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvc_status st = attention_block(s0, ss, B, l, 1, 0, NULL);
        for (int32_t i = 0; i < B && st == KVC_OK; i++) {
            if (!decode_hooks_active(ss[i])) continue;
            kvc_layer_ctx ctx = layer_ctx(s0, l, 1, NULL); /* session i's row of the batch */
            ctx.q = kvc_view_at(ctx.q, i, 0);
            ctx.attn = kvc_view_at(ctx.attn, i, 0);
            ctx.o = kvc_view_at(ctx.o, i, 0);
            ctx.resid = kvc_view_at(ctx.resid, i, 0);
            ctx.pos = s0->positions + i; /* its position, not row 0's */
            st = run_hooks(ss[i], &ctx, 1);
        }
        if (st == KVC_OK) st = mlp_block(s0, l, B);
        if (st != KVC_OK) {
            for (int32_t i = 0; i < B; i++) {
                kvc_cache_drop_from(&ss[i]->cache, l, ss[i]->pos);
                if (ss[i]->cache.compactions != before[i]) ss[i]->needs_reset = 1; /* evicted rows cannot come back */
            }
            free(before);
            return st;
        }
    }
    kvc_status st = logits_out(s0, 0, B, logits);
    if (st != KVC_OK)
        for (int32_t i = 0; i < B; i++) {
            kvc_cache_drop_from(&ss[i]->cache, c->n_layers - 1, ss[i]->pos);
            if (ss[i]->cache.compactions != before[i]) ss[i]->needs_reset = 1;
        }
    free(before);
    if (st != KVC_OK) return st;
    for (int32_t i = 0; i < B; i++) ss[i]->pos += 1;
    return KVC_OK;
}

kvc_status kvc_forward_batch(kvc_session *const *ss, int32_t B, const int32_t *ids, float *logits) {
    if (B <= 0 || !ss || !ids) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: need B >= 1 sessions and ids");
    if (!logits) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: logits buffer is NULL");
    kvc_session *s0 = ss[0];
    if (!s0) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: session 0 is NULL");
    const kvc_config *c = &s0->model->cfg;
    for (int32_t i = 0; i < B; i++) {
        const kvc_session *s = ss[i];
        if (!s) return kvc_fail(KVC_ERR_ARG, "kvc_forward_batch: session %d is NULL", i);
        if (s->model != s0->model) return kvc_fail(KVC_ERR_ARG, "session %d belongs to another model", i);
        if (s->needs_reset)
            return kvc_fail(KVC_ERR_ARG, "session %d failed in the middle of a compressed prefill: reset it", i);
        if (has_layer_hook(s)) return kvc_fail(KVC_ERR_ARG, "session %d has a press attached: detach it before batched decoding", i);
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return kvc_fail(KVC_ERR_ARG, "token id %d for session %d is outside the vocabulary [0, %d)", ids[i], i, c->vocab);
        for (int32_t j = 0; j < i; j++)
            if (ss[j] == s) return kvc_fail(KVC_ERR_ARG, "session %d is listed twice", i);
    }
    kvc_backend_lock(s0->be);
    kvc_status st = batch_locked(ss, B, ids, logits);
    kvc_backend_unlock(s0->be);
    return st;
}
