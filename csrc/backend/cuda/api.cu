/* The one exported symbol of libkvpress_c_cuda.so: kvc_cuda_get_api, the table of cuda_api.h.
 * Also the kernel entry points on host arrays (fp32 in and out, device inputs rounded to bf16) that
 * the tests compare with the CPU backend. */
#include <math.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "engine.cuh"

namespace kvc {

/* Every session shares the one device stream, and the decode graph is captured on it: calls from several
 * host threads (the Python module releases the GIL) take turns. Recursive, because a press hook called
 * inside a forward calls back into this table. */
static std::recursive_mutex g_device_lock;
#define DEVICE_LOCK() std::lock_guard<std::recursive_mutex> device_lock_(g_device_lock)

kvc_status init_with_host(const kvc_cuda_host *host); /* context.cu */
kvc_status sess_score(DSess *s, const kvc_dev_ctx *ctx, const kvc_press_config *cfg, int32_t layer);
kvc_status sess_scores_to_host(DSess *s, int32_t layer, const int64_t *lens, float *const *out);
kvc_status sess_probe_score(DSess *s, int32_t layer, const float *qa, int64_t p, const int64_t *real, int32_t kernel);
kvc_status sess_select_topk(DSess *s, int32_t layer, const int64_t *lens, const int64_t *k, int64_t *const *keep,
                            int64_t *n_keep);
kvc_status sess_compact(DSess *s, int32_t layer, const int64_t *const *keep, const int64_t *n_keep, int64_t reserve_rows);
kvc_status sess_download_layer(DSess *s, int32_t layer, float *const *k, float *const *v);
kvc_status ctx_download(const kvc_dev_ctx *ctx, int32_t which, int64_t row0, int64_t rows, float *out);
kvc_status ctx_dissimilarity(const kvc_dev_ctx *ctx, int32_t w, double *out);

/* Scratch of one kernel call, freed when it goes out of scope (after a stream sync). */
struct Temp {
    std::vector<std::pair<void *, size_t>> a;
    ~Temp() {
        cudaStreamSynchronize(g.stream);
        for (auto &x : a) dfree(x.first, x.second, MEM_ACT);
    }
    template <class T> kvc_status get(T **p, size_t count) {
        void *q = nullptr;
        KVC_TRY(dalloc(&q, sizeof(T) * (count ? count : 1), MEM_ACT, "kernel test buffer"));
        a.push_back({q, sizeof(T) * (count ? count : 1)});
        *p = (T *)q;
        return KVC_OK;
    }
    /* fp32 host -> bf16 device */
    kvc_status bf16_of(bf16 **p, const float *src, size_t count) {
        float *f;
        KVC_TRY(get(&f, count));
        KVC_TRY(get(p, count));
        CU_TRY(cudaMemcpyAsync(f, src, sizeof(float) * count, cudaMemcpyHostToDevice, g.stream), "upload");
        return f32_to_bf16(f, *p, (int64_t)count);
    }
    /* bf16 device -> fp32 host */
    kvc_status to_host(float *dst, const bf16 *src, size_t count) {
        float *f;
        KVC_TRY(get(&f, count));
        KVC_TRY(bf16_to_f32(src, f, (int64_t)count));
        CU_TRY(cudaMemcpyAsync(dst, f, sizeof(float) * count, cudaMemcpyDeviceToHost, g.stream), "download");
        CU_TRY(cudaStreamSynchronize(g.stream), "download");
        return KVC_OK;
    }
};

static kvc_status k_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    Temp t;
    bf16 *A, *B;
    float *C;
    KVC_TRY(t.bf16_of(&A, a, (size_t)m * k));
    KVC_TRY(t.bf16_of(&B, b, (size_t)n * k));
    KVC_TRY(t.get(&C, (size_t)m * n));
    KVC_TRY(gemm(A, k, B, k, C, n, 1, m, n, k, 0.f));
    CU_TRY(cudaMemcpyAsync(c, C, sizeof(float) * m * n, cudaMemcpyDeviceToHost, g.stream), "download");
    CU_TRY(cudaStreamSynchronize(g.stream), "matmul");
    return KVC_OK;
}

static kvc_status k_rmsnorm(const float *x, const float *r, const float *w, float *y, float *x_out, int64_t rows,
                            int64_t dim, float eps) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    Temp t;
    float *X, *W;
    bf16 *R = nullptr, *Y;
    KVC_TRY(t.get(&X, (size_t)rows * dim));
    KVC_TRY(t.get(&W, (size_t)dim));
    KVC_TRY(t.get(&Y, (size_t)rows * dim));
    CU_TRY(cudaMemcpyAsync(X, x, sizeof(float) * rows * dim, cudaMemcpyHostToDevice, g.stream), "upload");
    CU_TRY(cudaMemcpyAsync(W, w, sizeof(float) * dim, cudaMemcpyHostToDevice, g.stream), "upload");
    if (r) KVC_TRY(t.bf16_of(&R, r, (size_t)rows * dim));
    KVC_TRY(rmsnorm(X, R, dim, W, Y, rows, dim, eps));
    KVC_TRY(t.to_host(y, Y, (size_t)rows * dim));
    if (x_out) {
        CU_TRY(cudaMemcpyAsync(x_out, X, sizeof(float) * rows * dim, cudaMemcpyDeviceToHost, g.stream), "download");
        CU_TRY(cudaStreamSynchronize(g.stream), "rmsnorm");
    }
    return KVC_OK;
}

static kvc_status k_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                         int32_t pairing) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    Temp t;
    bf16 *X;
    int64_t *P;
    float *F;
    const size_t count = (size_t)n * heads * d;
    KVC_TRY(t.bf16_of(&X, x, count));
    KVC_TRY(t.get(&P, (size_t)n));
    KVC_TRY(t.get(&F, (size_t)d / 2));
    CU_TRY(cudaMemcpyAsync(P, pos, sizeof(int64_t) * n, cudaMemcpyHostToDevice, g.stream), "upload");
    CU_TRY(cudaMemcpyAsync(F, inv_freq, sizeof(float) * (d / 2), cudaMemcpyHostToDevice, g.stream), "upload");
    KVC_TRY(rope(X, (int64_t)heads * d, 0, n, heads, d, P, F, pairing));
    return t.to_host(x, X, count);
}

static kvc_status k_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    Temp t;
    std::vector<float> gu;
    try {
        gu.resize((size_t)rows * 2 * dim);
    } catch (...) {
        return fail(KVC_ERR_NOMEM, "out of memory: swiglu staging");
    }
    for (int64_t r = 0; r < rows; r++) {
        memcpy(&gu[(size_t)r * 2 * dim], gate + r * dim, sizeof(float) * dim);
        memcpy(&gu[(size_t)r * 2 * dim + dim], up + r * dim, sizeof(float) * dim);
    }
    bf16 *G;
    KVC_TRY(t.bf16_of(&G, gu.data(), gu.size()));
    KVC_TRY(swiglu(G, rows, dim));
    KVC_TRY(t.to_host(gu.data(), G, gu.size()));
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * dim, &gu[(size_t)r * 2 * dim], sizeof(float) * dim);
    return KVC_OK;
}

static kvc_status k_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                              const float *const *v, const int64_t *past_len, float scale, float *out,
                              int32_t force_prefill) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    if (Hkv > KVC_MAX_KV) return fail(KVC_ERR_UNSUPPORTED, "at most %d KV heads", KVC_MAX_KV);
    Temp t;
    bf16 *Q, *O;
    bf16 *kh[KVC_MAX_KV], *vh[KVC_MAX_KV];
    int32_t lens[KVC_MAX_KV];
    KVC_TRY(t.bf16_of(&Q, q, (size_t)n * H * d));
    KVC_TRY(t.get(&O, (size_t)n * H * d));
    for (int32_t h = 0; h < Hkv; h++) {
        const size_t rows = (size_t)(past_len[h] + n);
        KVC_TRY(t.bf16_of(&kh[h], k[h], rows * d));
        KVC_TRY(t.bf16_of(&vh[h], v[h], rows * d));
        lens[h] = (int32_t)(n == 1 && !force_prefill ? past_len[h] + 1 : past_len[h]);
    }
    bf16 **kd, **vd;
    int32_t *ld;
    KVC_TRY(t.get(&kd, (size_t)Hkv));
    KVC_TRY(t.get(&vd, (size_t)Hkv));
    KVC_TRY(t.get(&ld, (size_t)Hkv));
    CU_TRY(cudaMemcpyAsync(kd, kh, sizeof(bf16 *) * Hkv, cudaMemcpyHostToDevice, g.stream), "upload");
    CU_TRY(cudaMemcpyAsync(vd, vh, sizeof(bf16 *) * Hkv, cudaMemcpyHostToDevice, g.stream), "upload");
    CU_TRY(cudaMemcpyAsync(ld, lens, sizeof(int32_t) * Hkv, cudaMemcpyHostToDevice, g.stream), "upload");
    if (n == 1 && !force_prefill) {
        float *partial;
        KVC_TRY(t.get(&partial, decode_partial_floats(H, d, DECODE_SPLITS)));
        KVC_TRY(attention_decode(Q, H, Hkv, d, kd, vd, ld, scale, O, partial, DECODE_SPLITS));
    } else {
        KVC_TRY(attention_prefill(Q, (int64_t)H * d, n, H, Hkv, d, kd, vd, ld, scale, O, (int64_t)H * d));
    }
    return t.to_host(out, O, (size_t)n * H * d);
}

static kvc_status k_score(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer, const float *q,
                          const float *attn, int64_t n, const float *k, const float *v, int64_t len, float *scores) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    if (Hkv > KVC_MAX_KV) return fail(KVC_ERR_UNSUPPORTED, "at most %d KV heads", KVC_MAX_KV);
    if (!kvc_scorer_on_device(cfg->scorer))
        return fail(KVC_ERR_UNSUPPORTED, "scorer %d has no CUDA implementation", cfg->scorer);
    Temp t;
    bf16 *Q, *K, *V, *A = nullptr;
    float *S;
    KVC_TRY(t.bf16_of(&Q, q, (size_t)n * H * d));
    if (attn) KVC_TRY(t.bf16_of(&A, attn, (size_t)n * H * d));
    KVC_TRY(t.bf16_of(&K, k, (size_t)Hkv * len * d));
    KVC_TRY(t.bf16_of(&V, v, (size_t)Hkv * len * d));
    KVC_TRY(t.get(&S, (size_t)Hkv * len));
    HeadInfo hi;
    memset(&hi, 0, sizeof hi);
    for (int32_t h = 0; h < Hkv; h++) {
        hi.k[h] = K + (size_t)h * len * d;
        hi.v[h] = V + (size_t)h * len * d;
        hi.len[h] = hi.n_acc[h] = hi.vlimit[h] = len;
    }
    Buf att, stats;
    kvc_status st = score_layer(hi, H, Hkv, d, Q, (int64_t)H * d, A, (int64_t)H * d, n, cfg, layer, att, stats, S, len);
    if (st == KVC_OK &&
        cudaMemcpyAsync(scores, S, sizeof(float) * Hkv * len, cudaMemcpyDeviceToHost, g.stream) != cudaSuccess)
        st = cuda_fail(cudaGetLastError(), "scores download");
    if (st == KVC_OK && cudaStreamSynchronize(g.stream) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "scores");
    cudaStreamSynchronize(g.stream);
    att.release();
    stats.release();
    return st;
}

static kvc_status k_topk(const float *scores, int32_t heads, int64_t n, const int64_t *k, int64_t *keep) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    Temp t;
    float *S;
    int32_t *rows;
    KVC_TRY(t.get(&S, (size_t)heads * n));
    KVC_TRY(t.get(&rows, (size_t)n));
    CU_TRY(cudaMemcpyAsync(S, scores, sizeof(float) * heads * n, cudaMemcpyHostToDevice, g.stream), "upload");
    std::vector<int32_t> host((size_t)n);
    Buf tmp;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < heads && st == KVC_OK; h++) {
        const int64_t kk = k[h] < n ? (k[h] < 0 ? 0 : k[h]) : n;
        if (kk == 0) continue;
        st = topk_rows(S + (size_t)h * n, n, kk, rows, tmp);
        if (st == KVC_OK &&
            cudaMemcpyAsync(host.data(), rows, sizeof(int32_t) * kk, cudaMemcpyDeviceToHost, g.stream) != cudaSuccess)
            st = cuda_fail(cudaGetLastError(), "top-k download");
        if (st == KVC_OK && cudaStreamSynchronize(g.stream) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "top-k");
        for (int64_t i = 0; st == KVC_OK && i < kk; i++) keep[(size_t)h * n + i] = host[i];
    }
    cudaStreamSynchronize(g.stream);
    tmp.release();
    return st;
}

static kvc_status k_bench(int32_t what, const int64_t *dims, int32_t reps, double *seconds) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    if (what != 0 && what != 1) return fail(KVC_ERR_ARG, "bench: unknown kernel %d", what);
    Temp t;
    cudaEvent_t e0, e1;
    CU_TRY(cudaEventCreate(&e0), "bench events");
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return cuda_fail(cudaGetLastError(), "bench events");
    }
    kvc_status st = KVC_OK;
    bf16 *A = nullptr, *B = nullptr, *Cm = nullptr, *K = nullptr, *V = nullptr;
    bf16 **kd = nullptr, **vd = nullptr;
    int32_t *past = nullptr;
    const int64_t a0 = dims[0], a1 = dims[1], a2 = dims[2], a3 = what == 1 ? dims[3] : 0;
    /* values do not change the time: small constants keep the softmax finite */
    if (what == 0) {
        if ((st = t.get(&A, (size_t)a0 * a2)) == KVC_OK && (st = t.get(&B, (size_t)a1 * a2)) == KVC_OK)
            st = t.get(&Cm, (size_t)a0 * a1);
        if (st == KVC_OK && (cudaMemsetAsync(A, 0, sizeof(bf16) * a0 * a2, g.stream) != cudaSuccess ||
                             cudaMemsetAsync(B, 0, sizeof(bf16) * a1 * a2, g.stream) != cudaSuccess))
            st = cuda_fail(cudaGetLastError(), "bench init");
    } else {
        const int64_t n = a0, H = a1, Hkv = a2, d = a3;
        if (Hkv > KVC_MAX_KV || H % Hkv) st = fail(KVC_ERR_ARG, "bench: bad heads");
        if (st == KVC_OK && (st = t.get(&A, (size_t)n * H * d)) == KVC_OK && (st = t.get(&Cm, (size_t)n * H * d)) == KVC_OK &&
            (st = t.get(&K, (size_t)Hkv * n * d)) == KVC_OK && (st = t.get(&V, (size_t)Hkv * n * d)) == KVC_OK &&
            (st = t.get(&kd, (size_t)Hkv)) == KVC_OK && (st = t.get(&vd, (size_t)Hkv)) == KVC_OK)
            st = t.get(&past, (size_t)Hkv);
        if (st == KVC_OK) {
            bf16 *kh[KVC_MAX_KV], *vh[KVC_MAX_KV];
            for (int64_t h = 0; h < Hkv; h++) {
                kh[h] = K + h * n * d;
                vh[h] = V + h * n * d;
            }
            if (cudaMemsetAsync(A, 0, sizeof(bf16) * n * H * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(K, 0, sizeof(bf16) * Hkv * n * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(V, 0, sizeof(bf16) * Hkv * n * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(past, 0, sizeof(int32_t) * Hkv, g.stream) != cudaSuccess ||
                cudaMemcpyAsync(kd, kh, sizeof(bf16 *) * Hkv, cudaMemcpyHostToDevice, g.stream) != cudaSuccess ||
                cudaMemcpyAsync(vd, vh, sizeof(bf16 *) * Hkv, cudaMemcpyHostToDevice, g.stream) != cudaSuccess)
                st = cuda_fail(cudaGetLastError(), "bench init");
        }
    }
    double best = 1e30;
    for (int32_t r = 0; st == KVC_OK && r <= (reps > 0 ? reps : 1); r++) {
        cudaEventRecord(e0, g.stream);
        if (what == 0)
            st = gemm(A, a2, B, a2, Cm, a1, 0, a0, a1, a2, 0.f);
        else
            st = attention_prefill(A, a1 * a3, a0, (int32_t)a1, (int32_t)a2, (int32_t)a3, kd, vd, past,
                                   1.0f / sqrtf((float)a3), Cm, a1 * a3);
        cudaEventRecord(e1, g.stream);
        if (st == KVC_OK && cudaEventSynchronize(e1) != cudaSuccess) st = cuda_fail(cudaGetLastError(), "bench");
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (r > 0 && ms / 1e3 < best) best = ms / 1e3; /* r == 0: warm-up */
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    *seconds = best;
    return st;
}

/* ---- adapters for the table ---- */

static const char *a_device_name(void) { return g.ready ? g.name : ""; }
static kvc_status a_model_upload(const struct kvc_model *m, void **out) {
    DEVICE_LOCK();
    DModel *dm = nullptr;
    kvc_status st = model_upload(m, &dm);
    *out = dm;
    return st;
}
static void a_model_free(void *dm) { DEVICE_LOCK(); model_free((DModel *)dm); }
static kvc_status a_session_new(void *dm, int64_t capacity_hint, void **out) {
    DEVICE_LOCK();
    DSess *s = nullptr;
    KVC_TRY(session_new((DModel *)dm, &s));
    if (capacity_hint > 0) {
        for (int32_t l = 0; l < s->L; l++) {
            kvc_status st = reserve(s, l, capacity_hint);
            if (st != KVC_OK) {
                session_free(s);
                return st;
            }
        }
    }
    *out = s;
    return KVC_OK;
}
static void a_session_free(void *ds) { DEVICE_LOCK(); session_free((DSess *)ds); }
static void a_session_clear(void *ds) { DEVICE_LOCK(); session_clear((DSess *)ds); }
static kvc_status a_session_copy(void *dst, const void *src) {
    DEVICE_LOCK();
    return session_copy((DSess *)dst, (const DSess *)src);
}
static int64_t a_cache_len(void *ds, int32_t l, int32_t h) {
    DSess *s = (DSess *)ds;
    return s->len[(size_t)l * s->Hkv + h];
}
static const int64_t *a_cache_positions(void *ds, int32_t l, int32_t h) {
    DSess *s = (DSess *)ds;
    return s->pos[(size_t)l * s->Hkv + h];
}
static size_t a_cache_bytes(void *ds) { return ((DSess *)ds)->cache_bytes; }
static size_t a_peak_cache_bytes(void *ds) { return ((DSess *)ds)->cache_peak; }
static kvc_status a_truncate(void *ds, int32_t l, const int64_t *new_len) {
    DEVICE_LOCK();
    DSess *s = (DSess *)ds;
    for (int32_t h = 0; h < s->Hkv; h++) {
        const size_t i = (size_t)l * s->Hkv + h;
        if (new_len[h] < 0 || new_len[h] > s->len[i]) return fail(KVC_ERR_ARG, "truncate: bad length for head %d", h);
        s->len[i] = new_len[h];
    }
    return upload_lens(s, l);
}
static kvc_status a_reserve_all(void *ds, int64_t extra) {
    DEVICE_LOCK();
    DSess *s = (DSess *)ds;
    for (int32_t l = 0; l < s->L; l++) KVC_TRY(reserve(s, l, extra));
    return KVC_OK;
}
static kvc_status a_forward(void *ds, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb, int64_t pos0,
                            int64_t logits_row, float *logits, kvc_dev_hook hook, void *hook_user,
                            void *const *followers, const kvc_dev_hook *f_hooks, void *const *f_users,
                            int32_t n_followers) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    return forward((DSess *)ds, ids, n_ids, emb, n_emb, pos0, logits_row, logits, hook, hook_user,
                   (DSess *const *)followers, f_hooks, f_users, n_followers);
}
static kvc_status a_forward_batch(void *const *ds, int32_t B, const int32_t *ids, const int64_t *pos, float *logits) {
    DEVICE_LOCK();
    KVC_TRY(ensure_init());
    return forward_batch((DSess *const *)ds, B, ids, pos, logits);
}
static kvc_status a_score(void *ds, const kvc_dev_ctx *ctx, const kvc_press_config *cfg, int32_t layer) {
    DEVICE_LOCK();
    return sess_score((DSess *)ds, ctx, cfg, layer);
}
static kvc_status a_probe_score(void *ds, int32_t layer, const float *qa, int64_t p, const int64_t *real,
                                int32_t kernel) {
    DEVICE_LOCK();
    return sess_probe_score((DSess *)ds, layer, qa, p, real, kernel);
}
static kvc_status a_scores_to_host(void *ds, int32_t layer, const int64_t *lens, float *const *out) {
    DEVICE_LOCK();
    return sess_scores_to_host((DSess *)ds, layer, lens, out);
}
static kvc_status a_select_topk(void *ds, int32_t layer, const int64_t *lens, const int64_t *k, int64_t *const *keep,
                                int64_t *n_keep) {
    DEVICE_LOCK();
    return sess_select_topk((DSess *)ds, layer, lens, k, keep, n_keep);
}
static kvc_status a_compact(void *ds, int32_t layer, const int64_t *const *keep, const int64_t *n_keep, int64_t reserve) {
    DEVICE_LOCK();
    return sess_compact((DSess *)ds, layer, keep, n_keep, reserve);
}
static kvc_status a_download_layer(void *ds, int32_t layer, float *const *k, float *const *v) {
    DEVICE_LOCK();
    return sess_download_layer((DSess *)ds, layer, k, v);
}

static kvc_cuda_api make_api(void) {
    kvc_cuda_api a;
    memset(&a, 0, sizeof a);
    a.version = KVC_CUDA_API_VERSION;
    a.init = init_with_host;
    a.device_name = a_device_name;
    a.gemm_name = gemm_name;
    a.force_builtin_gemm = gemm_force_builtin;
    a.set_attention_kernel = attention_use_mma;
    a.memory_stats = memory_stats;
    a.reset_peak = reset_peak;
    a.k_matmul = k_matmul;
    a.k_rmsnorm = k_rmsnorm;
    a.k_rope = k_rope;
    a.k_swiglu = k_swiglu;
    a.k_attention = k_attention;
    a.k_score = k_score;
    a.k_topk = k_topk;
    a.bench = k_bench;
    a.model_upload = a_model_upload;
    a.model_free = a_model_free;
    a.session_new = a_session_new;
    a.session_free = a_session_free;
    a.session_clear = a_session_clear;
    a.session_copy = a_session_copy;
    a.cache_len = a_cache_len;
    a.cache_positions = a_cache_positions;
    a.cache_bytes = a_cache_bytes;
    a.peak_cache_bytes = a_peak_cache_bytes;
    a.truncate = a_truncate;
    a.reserve_all = a_reserve_all;
    a.forward = a_forward;
    a.forward_batch = a_forward_batch;
    a.score = a_score;
    a.probe_score = a_probe_score;
    a.scores_to_host = a_scores_to_host;
    a.select_topk = a_select_topk;
    a.compact = a_compact;
    a.download_layer = a_download_layer;
    a.download_ctx = ctx_download;
    a.dissimilarity = ctx_dissimilarity;
    return a;
}

static const kvc_cuda_api g_api = make_api();

} // namespace kvc

extern "C" __attribute__((visibility("default"))) const kvc_cuda_api *kvc_cuda_get_api(void) { return &kvc::g_api; }
