/* The device engine: model upload (the host model's fp32 weights, already dequantised by the core's
 * loaders, rounded to bf16 on the device), the ragged per-(layer, KV head) cache, and the forward
 * (prefill and decode) in the order of the CPU reference (engine/forward.c):
 *   x (fp32 residual) -> rmsnorm -> qkv GEMM (+bias) -> RoPE -> append K/V -> attention -> o GEMM
 *   -> hook (press) -> x += o fused into the next rmsnorm -> gate|up GEMM -> SwiGLU -> down GEMM
 *   accumulated into x (beta = 1).
 * Everything runs on one stream; the host waits only for logits and for the press hook's copies. */
#include <math.h>
#include <new>
#include <stdlib.h>
#include <string.h>

#include "engine.cuh"

namespace kvc {

/* ---- model upload ----------------------------------------------------------------------------- */

static kvc_status walloc(DModel *dm, void **p, size_t bytes, const char *what) {
    KVC_TRY(dalloc(p, bytes, MEM_WEIGHTS, what));
    dm->allocs.push_back({*p, bytes});
    dm->bytes += bytes;
    return KVC_OK;
}

/* fp32 host -> bf16 device through a staging buffer (64 MiB at a time) */
static kvc_status upload_bf16(const float *src, int64_t n, bf16 *dst, Buf &stage) {
    const int64_t chunk = 16 << 20;
    KVC_TRY(stage.need(sizeof(float) * (size_t)(n < chunk ? n : chunk), "weight upload staging"));
    for (int64_t i = 0; i < n; i += chunk) {
        const int64_t m = n - i < chunk ? n - i : chunk;
        CU_TRY(cudaMemcpyAsync(stage.p, src + i, sizeof(float) * m, cudaMemcpyHostToDevice, g.stream), "weight upload");
        KVC_TRY(f32_to_bf16(stage.as<float>(), dst + i, m));
    }
    CU_TRY(cudaStreamSynchronize(g.stream), "weight upload");
    return KVC_OK;
}

static kvc_status upload_f32(DModel *dm, const float *src, int64_t n, float **out, const char *what) {
    void *p;
    KVC_TRY(walloc(dm, &p, sizeof(float) * n, what));
    *out = (float *)p;
    CU_TRY(cudaMemcpy(p, src, sizeof(float) * n, cudaMemcpyHostToDevice), what);
    return KVC_OK;
}

static kvc_status model_upload_impl(const kvc_model *m, DModel *dm, Buf &stage) {
    const kvc_config &c = m->cfg;
    const int64_t D = c.hidden, V = c.vocab, F = c.ffn, qd = (int64_t)c.n_heads * c.head_dim,
                  kd = (int64_t)c.n_kv_heads * c.head_dim;
    if (c.n_kv_heads > KVC_MAX_KV)
        return fail(KVC_ERR_UNSUPPORTED, "the CUDA backend supports at most %d KV heads (model has %d)", KVC_MAX_KV,
                    c.n_kv_heads);
    if (c.head_dim % 8 != 0 || c.head_dim > 256)
        return fail(KVC_ERR_UNSUPPORTED, "the CUDA backend needs head_dim to be a multiple of 8, at most 256 (got %d)",
                    c.head_dim);
    dm->c = c;
    void *p;
    KVC_TRY(walloc(dm, &p, sizeof(bf16) * V * D, "token embeddings"));
    dm->tok = (bf16 *)p;
    KVC_TRY(upload_bf16(m->tok_embd, V * D, dm->tok, stage));
    if (m->lm_head == m->tok_embd) {
        dm->lm_head = dm->tok;
    } else {
        KVC_TRY(walloc(dm, &p, sizeof(bf16) * V * D, "lm_head"));
        dm->lm_head = (bf16 *)p;
        KVC_TRY(upload_bf16(m->lm_head, V * D, dm->lm_head, stage));
    }
    KVC_TRY(upload_f32(dm, m->out_norm, D, &dm->out_norm, "output norm"));
    KVC_TRY(upload_f32(dm, m->rope_inv_freq, c.head_dim / 2, &dm->inv_freq, "RoPE frequencies"));
    dm->layers.resize(c.n_layers);
    for (int32_t l = 0; l < c.n_layers; l++) {
        const kvc_layer_weights &W = m->layers[l];
        DLayer &Ld = dm->layers[l];
        memset(&Ld, 0, sizeof Ld);
        KVC_TRY(walloc(dm, &p, sizeof(bf16) * (qd + 2 * kd) * D, "q|k|v weights"));
        Ld.wqkv = (bf16 *)p;
        KVC_TRY(upload_bf16(W.wq, qd * D, Ld.wqkv, stage));
        KVC_TRY(upload_bf16(W.wk, kd * D, Ld.wqkv + qd * D, stage));
        KVC_TRY(upload_bf16(W.wv, kd * D, Ld.wqkv + (qd + kd) * D, stage));
        if (W.bq) {
            KVC_TRY(walloc(dm, &p, sizeof(float) * (qd + 2 * kd), "q|k|v bias"));
            Ld.bqkv = (float *)p;
            CU_TRY(cudaMemcpy(Ld.bqkv, W.bq, sizeof(float) * qd, cudaMemcpyHostToDevice), "bias upload");
            CU_TRY(cudaMemcpy(Ld.bqkv + qd, W.bk, sizeof(float) * kd, cudaMemcpyHostToDevice), "bias upload");
            CU_TRY(cudaMemcpy(Ld.bqkv + qd + kd, W.bv, sizeof(float) * kd, cudaMemcpyHostToDevice), "bias upload");
        }
        KVC_TRY(walloc(dm, &p, sizeof(bf16) * D * qd, "o weights"));
        Ld.wo = (bf16 *)p;
        KVC_TRY(upload_bf16(W.wo, D * qd, Ld.wo, stage));
        KVC_TRY(walloc(dm, &p, sizeof(bf16) * 2 * F * D, "gate|up weights"));
        Ld.wgu = (bf16 *)p;
        KVC_TRY(upload_bf16(W.w_gate, F * D, Ld.wgu, stage));
        KVC_TRY(upload_bf16(W.w_up, F * D, Ld.wgu + F * D, stage));
        KVC_TRY(walloc(dm, &p, sizeof(bf16) * D * F, "down weights"));
        Ld.wdown = (bf16 *)p;
        KVC_TRY(upload_bf16(W.w_down, D * F, Ld.wdown, stage));
        KVC_TRY(upload_f32(dm, W.attn_norm, D, &Ld.attn_norm, "attention norm"));
        KVC_TRY(upload_f32(dm, W.ffn_norm, D, &Ld.ffn_norm, "MLP norm"));
    }
    /* the small uploads above ran on the legacy stream, which g.stream (non-blocking) does not wait for */
    CU_TRY(cudaDeviceSynchronize(), "weight upload");
    return KVC_OK;
}

kvc_status model_upload(const kvc_model *m, DModel **out) {
    *out = nullptr;
    KVC_TRY(ensure_init());
    DModel *dm = new (std::nothrow) DModel();
    if (!dm) return fail(KVC_ERR_NOMEM, "out of memory: device model");
    Buf stage;
    kvc_status st = model_upload_impl(m, dm, stage);
    stage.release();
    if (st != KVC_OK) {
        model_free(dm);
        return st;
    }
    *out = dm;
    return KVC_OK;
}

void model_free(DModel *dm) {
    if (!dm) return;
    cudaStreamSynchronize(g.stream);
    for (auto &a : dm->allocs) dfree(a.p, a.bytes, MEM_WEIGHTS);
    delete dm;
}

/* ---- sessions and the ragged cache -------------------------------------------------------------- */

kvc_status session_new(DModel *dm, DSess **out) {
    *out = nullptr;
    KVC_TRY(ensure_init());
    DSess *s = new (std::nothrow) DSess();
    if (!s) return fail(KVC_ERR_NOMEM, "out of memory: device session");
    s->m = dm;
    s->L = dm->c.n_layers;
    s->Hkv = dm->c.n_kv_heads;
    s->d = dm->c.head_dim;
    const size_t nh = (size_t)s->L * s->Hkv;
    s->len = (int64_t *)calloc(nh, sizeof(int64_t));
    s->cap = (int64_t *)calloc(nh, sizeof(int64_t));
    s->len32 = (int32_t *)calloc(nh, sizeof(int32_t));
    s->pos = (int64_t **)calloc(nh, sizeof(int64_t *));
    s->arena = (void **)calloc(s->L, sizeof(void *));
    s->arena_bytes = (size_t *)calloc(s->L, sizeof(size_t));
    s->kh = (bf16 **)calloc(nh, sizeof(bf16 *));
    s->vh = (bf16 **)calloc(nh, sizeof(bf16 *));
    if (!s->len || !s->cap || !s->len32 || !s->pos || !s->arena || !s->arena_bytes || !s->kh || !s->vh) {
        session_free(s);
        return fail(KVC_ERR_NOMEM, "out of memory: device session");
    }
    s->dev_tables_bytes = nh * (2 * sizeof(bf16 *) + sizeof(int32_t));
    kvc_status st = dalloc(&s->dev_tables, s->dev_tables_bytes, MEM_CACHE, "cache tables");
    if (st != KVC_OK) {
        s->dev_tables = nullptr;
        session_free(s);
        return st;
    }
    s->kd = (bf16 **)s->dev_tables;
    s->vd = s->kd + nh;
    s->lend = (int32_t *)(s->vd + nh);
    if (cudaMemsetAsync(s->dev_tables, 0, s->dev_tables_bytes, g.stream) != cudaSuccess) {
        session_free(s);
        return cuda_fail(cudaGetLastError(), "cache tables");
    }
    s->cache_bytes = s->cache_peak = 0;
    *out = s;
    return KVC_OK;
}

void session_clear(DSess *s) {
    if (!s || !s->len || !s->cap || !s->len32 || !s->pos || !s->arena || !s->arena_bytes || !s->kh || !s->vh)
        return; /* a session whose creation ran out of host memory holds no cache */
    cudaStreamSynchronize(g.stream);
    for (int32_t l = 0; l < s->L; l++) {
        if (s->arena[l]) dfree(s->arena[l], s->arena_bytes[l], MEM_CACHE);
        s->cache_bytes -= s->arena_bytes[l];
        s->arena[l] = nullptr;
        s->arena_bytes[l] = 0;
    }
    const size_t nh = (size_t)s->L * s->Hkv;
    for (size_t i = 0; i < nh; i++) {
        free(s->pos[i]);
        s->pos[i] = nullptr;
        s->len[i] = s->cap[i] = 0;
        s->len32[i] = 0;
        s->kh[i] = s->vh[i] = nullptr;
    }
    if (s->dev_tables) cudaMemsetAsync(s->dev_tables, 0, s->dev_tables_bytes, g.stream);
}

kvc_status session_copy(DSess *dst, const DSess *src) {
    session_clear(dst);
    kvc_status st = KVC_OK;
    for (int32_t l = 0; l < dst->L && st == KVC_OK; l++) {
        int64_t rows = 0;
        for (int32_t h = 0; h < src->Hkv; h++) rows += src->len[(size_t)l * src->Hkv + h];
        if (rows > 0) st = layer_repack(dst, l, src->len + (size_t)l * src->Hkv, nullptr, nullptr, nullptr, src);
    }
    if (st != KVC_OK) session_clear(dst);
    return st;
}

void session_free(DSess *s) {
    if (!s) return;
    if (s->arena) session_clear(s);
    if (s->gexec) cudaGraphExecDestroy(s->gexec);
    if (s->dev_tables) dfree(s->dev_tables, s->dev_tables_bytes, MEM_CACHE);
    Buf *bufs[] = {&s->x, &s->xn, &s->qkv, &s->att, &s->o, &s->gu, &s->logits, &s->ids, &s->posd, &s->partial,
                   &s->scores, &s->att_s, &s->stats, &s->rows_d, &s->topk_tmp, &s->dsum, &s->probe_q};
    for (Buf *b : bufs) b->release();
    free(s->len);
    free(s->cap);
    free(s->len32);
    free(s->pos);
    free(s->arena);
    free(s->arena_bytes);
    free(s->kh);
    free(s->vh);
    free(s->keep32);
    delete s;
}

HeadInfo head_info(const DSess *s, int32_t l) {
    HeadInfo hi;
    memset(&hi, 0, sizeof hi);
    for (int32_t h = 0; h < s->Hkv; h++) {
        const size_t i = (size_t)l * s->Hkv + h;
        hi.k[h] = s->kh[i];
        hi.v[h] = s->vh[i];
        hi.len[h] = s->len[i];
        hi.n_acc[h] = s->len[i];
        hi.vstart[h] = 0;
        hi.vlimit[h] = s->len[i];
    }
    return hi;
}

kvc_status upload_lens(DSess *s, int32_t l) {
    const size_t o = (size_t)l * s->Hkv;
    for (int32_t h = 0; h < s->Hkv; h++) s->len32[o + h] = (int32_t)s->len[o + h];
    CU_TRY(cudaMemcpyAsync(s->lend + o, s->len32 + o, sizeof(int32_t) * s->Hkv, cudaMemcpyHostToDevice, g.stream),
           "cache lengths");
    return KVC_OK;
}

static kvc_status upload_ptrs(DSess *s, int32_t l) {
    const size_t o = (size_t)l * s->Hkv;
    CU_TRY(cudaMemcpyAsync(s->kd + o, s->kh + o, sizeof(bf16 *) * s->Hkv, cudaMemcpyHostToDevice, g.stream),
           "cache tables");
    CU_TRY(cudaMemcpyAsync(s->vd + o, s->vh + o, sizeof(bf16 *) * s->Hkv, cudaMemcpyHostToDevice, g.stream),
           "cache tables");
    return upload_lens(s, l);
}

kvc_status layer_repack(DSess *s, int32_t l, const int64_t *new_cap, const int32_t *keep_d, const int64_t *n_keep,
                        const int64_t *const *keep_host, const DSess *from) {
    const int32_t Hkv = s->Hkv, d = s->d;
    const size_t o = (size_t)l * Hkv;
    size_t bytes = 0;
    for (int32_t h = 0; h < Hkv; h++) bytes += (size_t)new_cap[h] * d * 2 * sizeof(bf16);
    void *arena = nullptr;
    KVC_TRY(dalloc(&arena, bytes, MEM_CACHE, "KV cache"));
    /* peak counts the old and the new arena together, as the CPU cache does */
    s->cache_bytes += bytes;
    if (s->cache_bytes > s->cache_peak) s->cache_peak = s->cache_bytes;
    int64_t **npos = (int64_t **)calloc(Hkv, sizeof(int64_t *));
    bool ok = npos != nullptr;
    for (int32_t h = 0; ok && h < Hkv; h++) ok = (npos[h] = (int64_t *)malloc(sizeof(int64_t) * (new_cap[h] + 1))) != nullptr;
    if (!ok) {
        if (npos)
            for (int32_t h = 0; h < Hkv; h++) free(npos[h]);
        free(npos);
        dfree(arena, bytes, MEM_CACHE);
        s->cache_bytes -= bytes;
        return fail(KVC_ERR_NOMEM, "out of memory: cache positions");
    }
    bf16 *nk[KVC_MAX_KV], *nv[KVC_MAX_KV];
    int64_t newlen[KVC_MAX_KV];
    {
        size_t off = 0;
        for (int32_t h = 0; h < Hkv; h++) {
            nk[h] = (bf16 *)((char *)arena + off);
            nv[h] = nk[h] + new_cap[h] * d;
            off += (size_t)new_cap[h] * d * 2 * sizeof(bf16);
        }
    }
    kvc_status st = KVC_OK;
    if (keep_d) {
        GatherInfo gi;
        memset(&gi, 0, sizeof gi);
        gi.off[0] = 0;
        for (int32_t h = 0; h < Hkv; h++) {
            gi.ok[h] = s->kh[o + h];
            gi.ov[h] = s->vh[o + h];
            gi.nk[h] = nk[h];
            gi.nv[h] = nv[h];
            gi.off[h + 1] = gi.off[h] + n_keep[h];
            newlen[h] = n_keep[h];
            for (int64_t i = 0; i < n_keep[h]; i++) npos[h][i] = s->pos[o + h][keep_host[h][i]];
        }
        st = gather_rows(gi, Hkv, d, keep_d);
    } else {
        const DSess *F = from ? from : s;
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const int64_t keep = F->len[o + h] < new_cap[h] ? F->len[o + h] : new_cap[h];
            newlen[h] = keep;
            if (keep > 0) {
                if (cudaMemcpyAsync(nk[h], F->kh[o + h], sizeof(bf16) * keep * d, cudaMemcpyDeviceToDevice, g.stream) !=
                        cudaSuccess ||
                    cudaMemcpyAsync(nv[h], F->vh[o + h], sizeof(bf16) * keep * d, cudaMemcpyDeviceToDevice, g.stream) !=
                        cudaSuccess)
                    st = cuda_fail(cudaGetLastError(), "cache copy");
                memcpy(npos[h], F->pos[o + h], sizeof(int64_t) * keep);
            }
        }
    }
    if (st == KVC_OK && cudaStreamSynchronize(g.stream) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "cache copy");
    if (st != KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) free(npos[h]);
        free(npos);
        dfree(arena, bytes, MEM_CACHE);
        s->cache_bytes -= bytes;
        return st;
    }
    if (s->arena[l]) dfree(s->arena[l], s->arena_bytes[l], MEM_CACHE);
    s->cache_bytes -= s->arena_bytes[l];
    s->arena[l] = arena;
    s->arena_bytes[l] = bytes;
    for (int32_t h = 0; h < Hkv; h++) {
        free(s->pos[o + h]);
        s->pos[o + h] = npos[h];
        s->kh[o + h] = nk[h];
        s->vh[o + h] = nv[h];
        s->cap[o + h] = new_cap[h];
        s->len[o + h] = newlen[h];
    }
    free(npos);
    return upload_ptrs(s, l);
}

kvc_status reserve(DSess *s, int32_t l, int64_t extra) {
    const size_t o = (size_t)l * s->Hkv;
    int grow = 0;
    int64_t nc[KVC_MAX_KV];
    for (int32_t h = 0; h < s->Hkv; h++) {
        const int64_t need = s->len[o + h] + extra;
        nc[h] = s->cap[o + h];
        if (need > nc[h]) {
            /* geometric growth: amortised O(1) copies per appended row */
            int64_t c = nc[h] + nc[h] / 2;
            nc[h] = c > need ? c : need;
            if (nc[h] < 16) nc[h] = 16;
            grow = 1;
        }
    }
    if (!grow) return KVC_OK;
    return layer_repack(s, l, nc, nullptr, nullptr, nullptr);
}

/* ---- forward ------------------------------------------------------------------------------------- */

/* Append n rows (K at column kcol, V at vcol of rows of stride ld) to layer l of session s at the
 * positions pos0.., after reserving room. past receives the lengths before the append. lend keeps
 * the old lengths until the caller moves them (the prefill attention reads them as `past`). */
static kvc_status append_rows(DSess *s, int32_t l, const bf16 *src, int64_t ld, int64_t kcol, int64_t vcol, int64_t n,
                              int64_t pos0, int64_t *past) {
    KVC_TRY(reserve(s, l, n));
    const size_t o = (size_t)l * s->Hkv;
    for (int32_t h = 0; h < s->Hkv; h++) {
        past[h] = s->len[o + h];
        int64_t *p = s->pos[o + h] + past[h];
        for (int64_t i = 0; i < n; i++) p[i] = pos0 + i;
    }
    KVC_TRY(append_kv(src, ld, kcol, vcol, n, s->Hkv, s->d, s->kd + o, s->vd + o, s->lend + o));
    for (int32_t h = 0; h < s->Hkv; h++) s->len[o + h] += n;
    return KVC_OK;
}

/* The end of a forward call: wait for the stream; after a failure (st, or the wait's), drain the stream
 * and clear its error so that the session can be used again. */
static kvc_status end_call(kvc_status st) {
    if (st == KVC_OK) {
        const cudaError_t e = cudaStreamSynchronize(g.stream);
        if (e != cudaSuccess) st = cuda_fail(e, "forward");
    }
    if (st != KVC_OK) {
        cudaStreamSynchronize(g.stream);
        cudaGetLastError();
    }
    return st;
}

/* drop rows at positions >= pos0 from layers 0..last (a failed call must lose nothing) */
static void rollback(DSess *s, int32_t last, int64_t pos0) {
    for (int32_t l = 0; l <= last && l < s->L; l++) {
        for (int32_t h = 0; h < s->Hkv; h++) {
            const size_t i = (size_t)l * s->Hkv + h;
            while (s->len[i] > 0 && s->pos[i][s->len[i] - 1] >= pos0) s->len[i]--;
        }
        upload_lens(s, l);
    }
}

static kvc_status layer_forward(DSess *s, int32_t l, int64_t n, int64_t pos0, kvc_dev_hook hook, void *hook_user,
                                DSess *const *fol, const kvc_dev_hook *fh, void *const *fu, int32_t nf) {
    const DModel *m = s->m;
    const kvc_config &c = m->c;
    const DLayer &W = m->layers[l];
    const int64_t D = c.hidden, H = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim, F = c.ffn;
    const int64_t qd = H * d, kd = Hkv * d, ldq = qd + 2 * kd;
    float *x = s->x.as<float>();
    bf16 *xn = s->xn.as<bf16>(), *qkv = s->qkv.as<bf16>(), *att = s->att.as<bf16>(), *o = s->o.as<bf16>();
    const int64_t *posd = s->posd.as<int64_t>();
    const float scale = 1.0f / sqrtf((float)d);

    KVC_TRY(rmsnorm(x, nullptr, 0, W.attn_norm, xn, n, D, c.rms_eps));
    KVC_TRY(gemm(xn, D, W.wqkv, D, qkv, ldq, 0, n, ldq, D, 0.f));
    if (W.bqkv) KVC_TRY(add_bias(qkv, ldq, W.bqkv, n, ldq));
    KVC_TRY(rope(qkv, ldq, 0, n, (int32_t)H, (int32_t)d, posd, m->inv_freq, c.rope_pairing));
    KVC_TRY(rope(qkv, ldq, qd, n, (int32_t)Hkv, (int32_t)d, posd, m->inv_freq, c.rope_pairing));

    int64_t past[KVC_MAX_KV];
    KVC_TRY(append_rows(s, l, qkv, ldq, qd, qd + kd, n, pos0, past));
    const size_t lo = (size_t)l * Hkv;
    if (n == 1) {
        KVC_TRY(add_lens(s->lend + lo, (int32_t)Hkv, 1));
        KVC_TRY(attention_decode(qkv, (int32_t)H, (int32_t)Hkv, (int32_t)d, s->kd + lo, s->vd + lo, s->lend + lo, scale,
                                 att, s->partial.as<float>(), DECODE_SPLITS));
    } else {
        KVC_TRY(attention_prefill(qkv, ldq, n, (int32_t)H, (int32_t)Hkv, (int32_t)d, s->kd + lo, s->vd + lo,
                                  s->lend + lo, scale, att, qd));
        KVC_TRY(upload_lens(s, l));
    }
    KVC_TRY(gemm(att, qd, W.wo, qd, o, D, 0, n, D, qd, 0.f));

    if (hook || nf > 0) {
        /* presses act on prefills only (n > 1); followers take this layer's rows for any n */
        kvc_dev_ctx ctx;
        ctx.c = {s, l, n, qkv, ldq, att, o, x};
        if (hook && n > 1) KVC_TRY(hook(hook_user, s, &ctx, l, n, past));
        for (int32_t i = 0; i < nf; i++) {
            DSess *f = fol[i];
            int64_t fpast[KVC_MAX_KV];
            KVC_TRY(append_rows(f, l, qkv, ldq, qd, qd + kd, n, pos0, fpast));
            KVC_TRY(upload_lens(f, l));
            if (n > 1 && fh && fh[i]) KVC_TRY(fh[i](fu ? fu[i] : nullptr, f, &ctx, l, n, fpast));
        }
    }

    /* x += o, fused into the MLP norm; then the MLP in row blocks, down projection added into x */
    KVC_TRY(rmsnorm(x, o, D, W.ffn_norm, xn, n, D, c.rms_eps));
    bf16 *gu = s->gu.as<bf16>();
    for (int64_t r0 = 0; r0 < n; r0 += MLP_ROWS) {
        const int64_t rows = n - r0 < MLP_ROWS ? n - r0 : MLP_ROWS;
        KVC_TRY(gemm(xn + r0 * D, D, W.wgu, D, gu, 2 * F, 0, rows, 2 * F, D, 0.f));
        KVC_TRY(swiglu(gu, rows, F));
        KVC_TRY(gemm(gu, 2 * F, W.wdown, F, x + r0 * D, D, 1, rows, D, F, 1.f));
    }
    return KVC_OK;
}

static kvc_status scratch(DSess *s, int64_t n, int64_t logit_rows) {
    const kvc_config &c = s->m->c;
    const int64_t D = c.hidden, qd = (int64_t)c.n_heads * c.head_dim, kd = (int64_t)c.n_kv_heads * c.head_dim;
    const int64_t blk = n < MLP_ROWS ? n : MLP_ROWS;
    KVC_TRY(s->x.need(sizeof(float) * n * D, "activations (residual)"));
    KVC_TRY(s->xn.need(sizeof(bf16) * n * D, "activations (norm)"));
    KVC_TRY(s->qkv.need(sizeof(bf16) * n * (qd + 2 * kd), "activations (q|k|v)"));
    KVC_TRY(s->att.need(sizeof(bf16) * n * qd, "activations (attention)"));
    KVC_TRY(s->o.need(sizeof(bf16) * n * D, "activations (o)"));
    KVC_TRY(s->gu.need(sizeof(bf16) * blk * 2 * c.ffn, "activations (gate|up)"));
    KVC_TRY(s->ids.need(sizeof(int32_t) * n, "token ids"));
    KVC_TRY(s->posd.need(sizeof(int64_t) * n, "positions"));
    KVC_TRY(s->partial.need(sizeof(float) * decode_partial_floats(c.n_heads, c.head_dim, DECODE_SPLITS),
                            "decode scratch"));
    if (logit_rows > 0) KVC_TRY(s->logits.need(sizeof(float) * logit_rows * c.vocab, "logits"));
    return KVC_OK;
}

static kvc_status logits_out(DSess *s, int64_t first, int64_t rows, float *logits) {
    const kvc_config &c = s->m->c;
    const int64_t D = c.hidden;
    KVC_TRY(rmsnorm(s->x.as<float>() + first * D, nullptr, 0, s->m->out_norm, s->xn.as<bf16>(), rows, D, c.rms_eps));
    KVC_TRY(gemm(s->xn.as<bf16>(), D, s->m->lm_head, D, s->logits.p, c.vocab, 1, rows, c.vocab, D, 0.f));
    CU_TRY(cudaMemcpyAsync(logits, s->logits.p, sizeof(float) * rows * c.vocab, cudaMemcpyDeviceToHost, g.stream),
           "logits copy");
    return KVC_OK;
}

/* ---- the decode step as a CUDA graph (opt-in: KVC_CUDA_GRAPHS=1) ------------------------------------
 * One token, no hook: everything after the host's bookkeeping (room in every layer, positions) is
 * device work that reads its inputs (token id, position, cache lengths and head pointers) from device
 * buffers at fixed addresses, so one captured graph replays every step; it is captured again when a
 * buffer it baked in has moved (a longer prefill grew it) or the GEMM choice changed. */

static int graphs_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVC_CUDA_GRAPHS");
        on = e && strcmp(e, "1") == 0;
    }
    return on;
}

/* the device part of one decode step: ids and posd hold the token and its position */
static kvc_status decode_body(DSess *s) {
    const DModel *m = s->m;
    const kvc_config &c = m->c;
    const int64_t D = c.hidden, H = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim, F = c.ffn;
    const int64_t qd = H * d, kd = Hkv * d, ldq = qd + 2 * kd;
    const float scale = 1.0f / sqrtf((float)d);
    float *x = s->x.as<float>();
    bf16 *xn = s->xn.as<bf16>(), *qkv = s->qkv.as<bf16>(), *att = s->att.as<bf16>(), *o = s->o.as<bf16>(),
         *gu = s->gu.as<bf16>();
    const int64_t *posd = s->posd.as<int64_t>();
    KVC_TRY(embed(m->tok, s->ids.as<int32_t>(), 1, D, x));
    for (int32_t l = 0; l < s->L; l++) {
        const DLayer &W = m->layers[l];
        const size_t lo = (size_t)l * Hkv;
        KVC_TRY(rmsnorm(x, nullptr, 0, W.attn_norm, xn, 1, D, c.rms_eps));
        KVC_TRY(gemm(xn, D, W.wqkv, D, qkv, ldq, 0, 1, ldq, D, 0.f));
        if (W.bqkv) KVC_TRY(add_bias(qkv, ldq, W.bqkv, 1, ldq));
        KVC_TRY(rope(qkv, ldq, 0, 1, (int32_t)H, (int32_t)d, posd, m->inv_freq, c.rope_pairing));
        KVC_TRY(rope(qkv, ldq, qd, 1, (int32_t)Hkv, (int32_t)d, posd, m->inv_freq, c.rope_pairing));
        KVC_TRY(append_kv(qkv, ldq, qd, qd + kd, 1, (int32_t)Hkv, (int32_t)d, s->kd + lo, s->vd + lo, s->lend + lo));
        KVC_TRY(add_lens(s->lend + lo, (int32_t)Hkv, 1));
        KVC_TRY(attention_decode(qkv, (int32_t)H, (int32_t)Hkv, (int32_t)d, s->kd + lo, s->vd + lo, s->lend + lo, scale,
                                 att, s->partial.as<float>(), DECODE_SPLITS));
        KVC_TRY(gemm(att, qd, W.wo, qd, o, D, 0, 1, D, qd, 0.f));
        KVC_TRY(rmsnorm(x, o, D, W.ffn_norm, xn, 1, D, c.rms_eps));
        KVC_TRY(gemm(xn, D, W.wgu, D, gu, 2 * F, 0, 1, 2 * F, D, 0.f));
        KVC_TRY(swiglu(gu, 1, F));
        KVC_TRY(gemm(gu, 2 * F, W.wdown, F, x, D, 1, 1, D, F, 1.f));
    }
    KVC_TRY(rmsnorm(x, nullptr, 0, m->out_norm, xn, 1, D, c.rms_eps));
    return gemm(xn, D, m->lm_head, D, s->logits.p, c.vocab, 1, 1, c.vocab, D, 0.f);
}

/* KVC_OK: the step ran as a graph; KVC_ERR_UNSUPPORTED: not captured (the caller runs it eagerly) */
static kvc_status decode_graph(DSess *s, const int32_t *ids, int64_t pos0, int64_t logits_row, float *logits) {
    const kvc_config &c = s->m->c;
    KVC_TRY(scratch(s, 1, 1));
    for (int32_t l = 0; l < s->L; l++) KVC_TRY(reserve(s, l, 1));
    const void *sig[11] = {s->x.p, s->xn.p, s->qkv.p, s->att.p, s->o.p, s->gu.p, s->logits.p, s->ids.p, s->posd.p,
                           s->partial.p, (const void *)(intptr_t)(gemm_builtin_forced() + 1)};
    if (s->gexec && memcmp(sig, s->gsig, sizeof sig) != 0) {
        cudaGraphExecDestroy(s->gexec);
        s->gexec = nullptr;
    }
    if (!s->gexec) {
        CU_TRY(cudaStreamSynchronize(g.stream), "decode graph");
        CU_TRY(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal), "decode graph capture");
        kvc_status st = decode_body(s);
        cudaGraph_t graph = nullptr;
        cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
        if (st == KVC_OK && e == cudaSuccess && graph) e = cudaGraphInstantiate(&s->gexec, graph, 0);
        if (graph) cudaGraphDestroy(graph);
        if (st != KVC_OK || e != cudaSuccess || !s->gexec) {
            cudaGetLastError();
            s->gexec = nullptr;
            s->graph_off = 1;
            return KVC_ERR_UNSUPPORTED;
        }
        memcpy(s->gsig, sig, sizeof sig);
    }
    CU_TRY(cudaMemcpyAsync(s->ids.p, ids, sizeof(int32_t), cudaMemcpyHostToDevice, g.stream), "token id");
    CU_TRY(cudaMemcpyAsync(s->posd.p, &pos0, sizeof(int64_t), cudaMemcpyHostToDevice, g.stream), "position");
    cudaError_t e = cudaGraphLaunch(s->gexec, g.stream);
    if (e == cudaSuccess && logits_row != KVC_ROW_NONE)
        e = cudaMemcpyAsync(logits, s->logits.p, sizeof(float) * c.vocab, cudaMemcpyDeviceToHost, g.stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(g.stream);
    if (e != cudaSuccess) {
        kvc_status st = cuda_fail(e, "decode step (graph)");
        for (int32_t l = 0; l < s->L; l++) upload_lens(s, l); /* the host lengths were not moved */
        return st;
    }
    /* the graph appended one row to every head of every layer: mirror it on the host */
    for (int32_t l = 0; l < s->L; l++)
        for (int32_t h = 0; h < s->Hkv; h++) {
            const size_t i = (size_t)l * s->Hkv + h;
            s->pos[i][s->len[i]] = pos0;
            s->len[i] += 1;
        }
    return KVC_OK;
}

kvc_status forward(DSess *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb, int64_t pos0,
                   int64_t logits_row, float *logits, kvc_dev_hook hook, void *hook_user, DSess *const *fol,
                   const kvc_dev_hook *fh, void *const *fu, int32_t nf) {
    if (n_ids == 1 && n_emb == 0 && nf == 0 && !s->graph_off && graphs_enabled()) {
        const kvc_status st = decode_graph(s, ids, pos0, logits_row, logits);
        if (st != KVC_ERR_UNSUPPORTED) return st;
    }
    const int64_t n = n_ids + n_emb;
    const kvc_config &c = s->m->c;
    const int64_t D = c.hidden;
    const int64_t lrows = logits_row == KVC_ROW_ALL ? n : logits_row == KVC_ROW_NONE ? 0 : 1;
    kvc_status sst = scratch(s, n, lrows);
    if (sst != KVC_OK) {
        /* a call too long for the device: give back what it grabbed, so the next call can run */
        Buf *bufs[] = {&s->x, &s->xn, &s->qkv, &s->att, &s->o, &s->gu, &s->logits, &s->ids, &s->posd};
        for (Buf *b : bufs) b->release();
        return sst;
    }
    if (n_ids > 0) {
        CU_TRY(cudaMemcpyAsync(s->ids.p, ids, sizeof(int32_t) * n_ids, cudaMemcpyHostToDevice, g.stream), "token ids");
        KVC_TRY(embed(s->m->tok, s->ids.as<int32_t>(), n_ids, D, s->x.as<float>()));
    }
    if (n_emb > 0)
        CU_TRY(cudaMemcpyAsync(s->x.as<float>() + n_ids * D, emb, sizeof(float) * n_emb * D, cudaMemcpyHostToDevice,
                               g.stream),
               "input embeddings");
    KVC_TRY(iota64(s->posd.as<int64_t>(), pos0, n));
    kvc_status st = KVC_OK;
    int32_t l = 0; /* afterwards the layers < l hold rows of this call (a failed one may hold some) */
    for (; l < s->L && st == KVC_OK; l++) st = layer_forward(s, l, n, pos0, hook, hook_user, fol, fh, fu, nf);
    if (st == KVC_OK && lrows > 0) st = logits_out(s, logits_row == KVC_ROW_ALL ? 0 : logits_row, lrows, logits);
    st = end_call(st);
    if (st != KVC_OK) {
        rollback(s, l - 1, pos0);
        for (int32_t i = 0; i < nf; i++) rollback(fol[i], l - 1, pos0);
    }
    return st;
}

/* One token for each of B sessions: the weight GEMMs run once on B rows; append and attention per
 * session over its own ragged cache (scratch lives in session 0). */
kvc_status forward_batch(DSess *const *ss, int32_t B, const int32_t *ids, const int64_t *pos, float *logits) {
    DSess *s = ss[0];
    const DModel *m = s->m;
    const kvc_config &c = m->c;
    const int64_t D = c.hidden, H = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim, F = c.ffn;
    const int64_t qd = H * d, kd = Hkv * d, ldq = qd + 2 * kd;
    const float scale = 1.0f / sqrtf((float)d);
    KVC_TRY(scratch(s, B, B));
    KVC_TRY(s->partial.need(sizeof(float) * decode_partial_floats(c.n_heads, c.head_dim, DECODE_SPLITS) * B,
                            "decode scratch"));
    CU_TRY(cudaMemcpyAsync(s->ids.p, ids, sizeof(int32_t) * B, cudaMemcpyHostToDevice, g.stream), "token ids");
    CU_TRY(cudaMemcpyAsync(s->posd.p, pos, sizeof(int64_t) * B, cudaMemcpyHostToDevice, g.stream), "positions");
    float *x = s->x.as<float>();
    bf16 *xn = s->xn.as<bf16>(), *qkv = s->qkv.as<bf16>(), *att = s->att.as<bf16>(), *o = s->o.as<bf16>(),
         *gu = s->gu.as<bf16>();
    KVC_TRY(embed(m->tok, s->ids.as<int32_t>(), B, D, x));
    int32_t l = 0;
    kvc_status st = KVC_OK;
    for (; l < s->L && st == KVC_OK; l++) {
        const DLayer &W = m->layers[l];
        const size_t lo = (size_t)l * Hkv;
        st = rmsnorm(x, nullptr, 0, W.attn_norm, xn, B, D, c.rms_eps);
        if (st == KVC_OK) st = gemm(xn, D, W.wqkv, D, qkv, ldq, 0, B, ldq, D, 0.f);
        if (st == KVC_OK && W.bqkv) st = add_bias(qkv, ldq, W.bqkv, B, ldq);
        if (st == KVC_OK) st = rope(qkv, ldq, 0, B, (int32_t)H, (int32_t)d, s->posd.as<int64_t>(), m->inv_freq, c.rope_pairing);
        if (st == KVC_OK) st = rope(qkv, ldq, qd, B, (int32_t)Hkv, (int32_t)d, s->posd.as<int64_t>(), m->inv_freq, c.rope_pairing);
        for (int32_t i = 0; i < B && st == KVC_OK; i++) {
            DSess *si = ss[i];
            int64_t past[KVC_MAX_KV];
            st = append_rows(si, l, qkv + i * ldq, ldq, qd, qd + kd, 1, pos[i], past);
            if (st == KVC_OK) st = add_lens(si->lend + lo, (int32_t)Hkv, 1);
            if (st == KVC_OK)
                st = attention_decode(qkv + i * ldq, (int32_t)H, (int32_t)Hkv, (int32_t)d, si->kd + lo, si->vd + lo,
                                      si->lend + lo, scale, att + i * qd,
                                      s->partial.as<float>() + decode_partial_floats(c.n_heads, c.head_dim, DECODE_SPLITS) * i,
                                      DECODE_SPLITS);
        }
        if (st == KVC_OK) st = gemm(att, qd, W.wo, qd, o, D, 0, B, D, qd, 0.f);
        if (st == KVC_OK) st = rmsnorm(x, o, D, W.ffn_norm, xn, B, D, c.rms_eps);
        if (st == KVC_OK) st = gemm(xn, D, W.wgu, D, gu, 2 * F, 0, B, 2 * F, D, 0.f);
        if (st == KVC_OK) st = swiglu(gu, B, F);
        if (st == KVC_OK) st = gemm(gu, 2 * F, W.wdown, F, x, D, 1, B, D, F, 1.f);
    }
    if (st == KVC_OK) st = logits_out(s, 0, B, logits);
    st = end_call(st);
    if (st != KVC_OK)
        for (int32_t i = 0; i < B; i++) rollback(ss[i], l - 1, pos[i]);
    return st;
}

} // namespace kvc
