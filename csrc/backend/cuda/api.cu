/* The CUDA backend's table (core/backend.h) and the two symbols the core's loader reads. Every entry
 * resolves views to device pointers and launches the kernels of this folder on the one stream; the
 * core serialises calls (kvc_backend_lock), so the backend-wide scratch needs no lock of its own. */
#include <math.h>
#include <string.h>

#include <vector>

#include "kv_rows.cuh"

namespace kvc {

/* Bumped when something a captured graph baked in changes: the decode scratch moved, or a setting chose
 * other kernels. A graph of an older generation is captured again (graph_launch says so). */
static uint64_t g_generation = 1;
static Buf g_partial;

/* Scratch of one benchmark call, freed when it goes out of scope (after a stream sync). */
struct Temp {
    std::vector<std::pair<void *, size_t>> a;
    ~Temp() {
        stream_wait();
        for (auto &x : a) dfree(x.first, x.second, MEM_ACT);
    }
    template <class T> kvc_status get(T **p, size_t count) {
        void *q = nullptr;
        KVC_TRY(dalloc(&q, sizeof(T) * (count ? count : 1), MEM_ACT, "benchmark buffer"));
        a.push_back({q, sizeof(T) * (count ? count : 1)});
        *p = (T *)q;
        return KVC_OK;
    }
};

static kvc_status k_bench(int32_t what, const int64_t *dims, int32_t reps, double *seconds) {
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
    int32_t *past = nullptr, *lens = nullptr;
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
        if (st == KVC_OK) st = t.get(&lens, (size_t)Hkv);
        if (st == KVC_OK) {
            bf16 *kh[KVC_MAX_KV], *vh[KVC_MAX_KV];
            int32_t lens_h[KVC_MAX_KV];
            for (int64_t h = 0; h < Hkv; h++) {
                lens_h[h] = (int32_t)n; /* every head holds the n rows (cuDNN's per-entry lengths) */
                kh[h] = K + h * n * d;
                vh[h] = V + h * n * d;
            }
            if (cudaMemsetAsync(A, 0, sizeof(bf16) * n * H * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(K, 0, sizeof(bf16) * Hkv * n * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(V, 0, sizeof(bf16) * Hkv * n * d, g.stream) != cudaSuccess ||
                cudaMemsetAsync(past, 0, sizeof(int32_t) * Hkv, g.stream) != cudaSuccess ||
                h2d(lens, lens_h, sizeof(int32_t) * Hkv) != cudaSuccess ||
                h2d(kd, kh, sizeof(bf16 *) * Hkv) != cudaSuccess ||
                h2d(vd, vh, sizeof(bf16 *) * Hkv) != cudaSuccess)
                st = cuda_fail(cudaGetLastError(), "bench init");
        }
    }
    double best = 1e30;
    for (int32_t r = 0; st == KVC_OK && r <= (reps > 0 ? reps : 1); r++) {
        cudaEventRecord(e0, g.stream);
        if (what == 0)
            st = gemm(A, a2, B, a2, Cm, a1, 0, a0, a1, a2, 0.f);
        else if (attention_cudnn_enabled()) { /* the kernel the setting chose, or the reason it cannot run */
            st = attention_cudnn(A, a1 * a3, a0, (int32_t)a1, (int32_t)a2, (int32_t)a3, K, V, a0 * a3, lens, a0,
                                 1.0f / sqrtf((float)a3), Cm, a1 * a3);
            if (st == KVC_ERR_UNSUPPORTED) st = fail(KVC_ERR_UNSUPPORTED, "bench: cuDNN has no attention plan for this shape");
        } else
            st = attention_prefill(A, a1 * a3, a0, (int32_t)a1, (int32_t)a2, (int32_t)a3, Bf16Rows{kd, vd}, past,
                                   nullptr, 1.0f / sqrtf((float)a3), 0.0f, Cm, a1 * a3);
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

/* ---- the decoder layer's kernels ---- */

static kvc_status need(int ok, const char *what) { return ok ? KVC_OK : fail(KVC_ERR_INTERNAL, "CUDA %s: unexpected layout", what); }

static kvc_status t_embed(kvc_view table, kvc_view ids, int64_t n, int64_t D, kvc_view x) {
    KVC_TRY(need(table.buf->dtype == KVC_BF16 && ids.buf->dtype == KVC_I32 && x.buf->dtype == KVC_F32 && x.ld == D, "embed"));
    return embed(at<bf16>(table), at<int32_t>(ids), n, D, at<float>(x));
}

static kvc_status t_rmsnorm(kvc_view x, const kvc_view *add, kvc_view w, kvc_view y, int64_t rows, int64_t D, float eps) {
    KVC_TRY(need(x.buf->dtype == KVC_F32 && x.ld == D && w.buf->dtype == KVC_F32 && y.buf->dtype == KVC_BF16 && y.ld == D &&
                     (!add || add->buf->dtype == KVC_BF16),
                 "rmsnorm"));
    return rmsnorm(at<float>(x), add ? at<bf16>(*add) : nullptr, add ? add->ld : 0, at<float>(w), at<bf16>(y), rows, D, eps);
}

static kvc_status t_matmul(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate) {
    KVC_TRY(need(a.buf->dtype == KVC_BF16 && w.buf->dtype == KVC_BF16, "matmul"));
    const int c_f32 = c.buf->dtype == KVC_F32;
    return gemm(at<bf16>(a), a.ld, at<bf16>(w), w.ld, at<char>(c), c.ld, c_f32, m, n, k, accumulate ? 1.f : 0.f);
}

static kvc_status t_add_bias(kvc_view y, kvc_view b, int64_t rows, int64_t dim) {
    KVC_TRY(need(y.buf->dtype == KVC_BF16 && b.buf->dtype == KVC_F32, "add_bias"));
    return add_bias(at<bf16>(y), y.ld, at<float>(b), rows, dim);
}

static kvc_status t_rope(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view pos, kvc_view inv_freq,
                         int32_t pairing, float mscale) {
    KVC_TRY(need(x.buf->dtype == KVC_BF16 && pos.buf->dtype == KVC_I64 && inv_freq.buf->dtype == KVC_F32, "rope"));
    return rope(at<bf16>(x), x.ld, col0, n, heads, d, at<int64_t>(pos), at<float>(inv_freq), pairing, mscale);
}

static kvc_status t_head_rmsnorm(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view w, float eps) {
    KVC_TRY(need(x.buf->dtype == KVC_BF16 && w.buf->dtype == KVC_F32, "head_rmsnorm"));
    return head_rmsnorm(at<bf16>(x), x.ld, col0, n, heads, d, at<float>(w), eps);
}

static kvc_status t_attention(kvc_view q, int64_t n, int32_t H, kvc_kv *kv, float scale, float softcap, kvc_view start,
                              kvc_view out, int32_t flags) {
    KVC_TRY(need(q.buf->dtype == KVC_BF16 && out.buf->dtype == KVC_BF16, "attention"));
    const int32_t Hkv = kv->Hkv, d = kv->d;
    bf16 **kd = kv->kd;
    if (kv->dk && !kv->typed) { /* ThinK-pruned rows: the kernels read them expanded to d channels (kv_pruned.cu) */
        const bf16 *heads[KVC_MAX_KV];
        KVC_TRY(kv_keys_full(kv, heads, &kd));
    }
    /* a sliding window's first row per (query, KV head), read by the kernels from the device (graph-safe) */
    if (start.buf && (start.buf->dtype != KVC_I64 || start.ld != Hkv))
        return fail(KVC_ERR_INTERNAL, "attention: window starts must be i64 [n, Hkv]");
    const int64_t *lo = start.buf ? at<int64_t>(start) : nullptr;
    if (n == 1 && !(flags & KVC_ATTN_FORCE_PREFILL)) {
        /* split-K decode over every row the device lengths say (they include this call's row) */
        const size_t bytes = sizeof(float) * decode_partial_floats(H, d, DECODE_SPLITS);
        if (bytes > g_partial.bytes) {
            /* cudaMalloc/cudaFree are illegal while the stream is captured: the engine's eager first
             * step sizes this scratch, so growing here during a capture is a contract violation */
            cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
            CU_TRY(cudaStreamIsCapturing(g.stream, &cs), "attention");
            if (cs != cudaStreamCaptureStatusNone)
                return fail(KVC_ERR_UNSUPPORTED, "CUDA decode scratch must grow during a graph capture: run one eager step first");
            KVC_TRY(scratch(g_partial, bytes, "decode scratch"));
            g_generation++;
        }
        if (kv->typed) /* the rows in their type: decoded in the kernel's loads */
            return with_typed_rows(kv, [&](const auto &src) {
                return attention_decode(at<bf16>(q), H, Hkv, d, src, kv->lend, lo, scale, softcap, at<bf16>(out), g_partial.as<float>(),
                                        DECODE_SPLITS);
            });
        return attention_decode(at<bf16>(q), H, Hkv, d, Bf16Rows{kd, kv->vd}, kv->lend, lo, scale, softcap, at<bf16>(out),
                                g_partial.as<float>(), DECODE_SPLITS);
    }
    if (!lo && !kv->dk && !kv->typed && !(softcap > 0) && attention_cudnn_enabled()) { /* cuDNN where the heads lie at one stride */
        const int64_t stride = Hkv > 1 ? kv->kh[1] - kv->kh[0] : kv->cap[0] * d;
        int64_t most = 1;
        int uniform = stride > 0 && kv->vh[0] && kv->kh[0];
        for (int32_t h = 0; h < Hkv && uniform; h++) {
            uniform = kv->kh[h] == kv->kh[0] + h * stride && kv->vh[h] == kv->vh[0] + h * stride;
            most = kv->cap[h] > most ? kv->cap[h] : most;
        }
        if (uniform) {
            const kvc_status st = attention_cudnn(at<bf16>(q), q.ld, n, H, Hkv, d, kv->kh[0], kv->vh[0], stride, kv->lend,
                                                  most, scale, at<bf16>(out), out.ld);
            if (st != KVC_ERR_UNSUPPORTED) return st;
        }
    }
    /* the prefill kernels read past = len - n per head */
    CU_TRY(cudaMemcpyAsync(kv->pastd, kv->lend, sizeof(int32_t) * Hkv, cudaMemcpyDeviceToDevice, g.stream), "attention");
    KVC_TRY(add_lens(kv->pastd, Hkv, -(int32_t)n));
    /* attention_prefill picks the kernel: the mma one when it is preferred (attention_kernel 1) and takes the
     * shape (head_dim 64 or 128, aligned rows), else WMMA or the generic one (head_dim 80, 96, 256, ...) */
    if (kv->typed) /* the rows in their type: decoded a tile at a time into shared memory */
        return with_typed_rows(kv, [&](const auto &src) {
            return attention_prefill(at<bf16>(q), q.ld, n, H, Hkv, d, src, kv->pastd, lo, scale, softcap, at<bf16>(out), out.ld);
        });
    return attention_prefill(at<bf16>(q), q.ld, n, H, Hkv, d, Bf16Rows{kd, kv->vd}, kv->pastd, lo, scale, softcap, at<bf16>(out),
                             out.ld);
}

static kvc_status t_swiglu(kvc_view gu, int64_t rows, int64_t F) {
    KVC_TRY(need(gu.buf->dtype == KVC_BF16 && gu.ld == 2 * F, "swiglu"));
    return swiglu(at<bf16>(gu), rows, F);
}

static kvc_status t_geglu(kvc_view gu, int64_t rows, int64_t F) {
    KVC_TRY(need(gu.buf->dtype == KVC_BF16 && gu.ld == 2 * F, "geglu"));
    return geglu(at<bf16>(gu), rows, F);
}

static kvc_status t_scale(kvc_view x, int64_t rows, int64_t cols, float alpha) {
    KVC_TRY(need(x.buf->dtype == KVC_F32, "scale"));
    return scale_rows(at<float>(x), x.ld, rows, cols, alpha);
}

static kvc_status t_moe_route(kvc_view logits, int64_t n, int32_t E, int32_t k, int32_t norm, kvc_view ids, kvc_view w) {
    KVC_TRY(need(logits.buf->dtype == KVC_F32 && ids.buf->dtype == KVC_I32 && w.buf->dtype == KVC_F32, "moe_route"));
    return moe_route(at<float>(logits), logits.ld, n, E, k, norm, at<int32_t>(ids), ids.ld, at<float>(w), w.ld);
}

static kvc_status t_gather_rows(kvc_view src, kvc_view idx, int64_t n, int64_t D, kvc_view dst) {
    KVC_TRY(need(src.buf->dtype == KVC_BF16 && dst.buf->dtype == KVC_BF16 && idx.buf->dtype == KVC_I32, "gather_rows"));
    return gather_rows(at<bf16>(src), src.ld, at<int32_t>(idx), n, D, at<bf16>(dst), dst.ld);
}

static kvc_status t_moe_combine(kvc_view x, kvc_view y, kvc_view w, kvc_view pos, int64_t n, int32_t k, int64_t D) {
    KVC_TRY(need(x.buf->dtype == KVC_F32 && y.buf->dtype == KVC_BF16 && w.buf->dtype == KVC_F32 && pos.buf->dtype == KVC_I32,
                 "moe_combine"));
    return moe_combine(at<float>(x), x.ld, at<bf16>(y), y.ld, at<float>(w), w.ld, at<int32_t>(pos), pos.ld, n, k, D);
}

/* ---- graphs: the decode step captured once, replayed every token ---- */

} // namespace kvc

struct kvc_graph {
    cudaGraphExec_t exec;
    uint64_t generation;
};

namespace kvc {

static kvc_status t_graph_capture(kvc_graph **gp, kvc_status (*run)(void *), void *user) {
    CU_TRY(stream_wait(), "decode graph");
    CU_TRY(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal), "decode graph capture");
    kvc_status st = run(user);
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
    cudaGraphExec_t exec = nullptr;
    if (st == KVC_OK && e == cudaSuccess && graph) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (st != KVC_OK || e != cudaSuccess || !exec) {
        if (st == KVC_OK) st = cuda_fail(e != cudaSuccess ? e : cudaErrorUnknown, "decode graph capture");
        cudaGetLastError();
        return st;
    }
    kvc_graph *ng = (kvc_graph *)calloc(1, sizeof *ng);
    if (!ng) {
        cudaGraphExecDestroy(exec);
        return fail(KVC_ERR_NOMEM, "out of memory: graph");
    }
    ng->exec = exec;
    ng->generation = g_generation + kv_layout_generation; /* both only grow */
    if (*gp) {
        cudaGraphExecDestroy((*gp)->exec);
        free(*gp);
    }
    *gp = ng;
    return KVC_OK;
}

static kvc_status t_graph_launch(kvc_graph *gr) {
    if (gr->generation != g_generation + kv_layout_generation) return KVC_ERR_UNSUPPORTED; /* capture again */
    CU_TRY(cudaGraphLaunch(gr->exec, g.stream), "decode step (graph)");
    CU_TRY(stream_wait(), "decode step (graph)");
    return KVC_OK;
}

static void t_graph_free(kvc_graph *gr) {
    if (!gr) return;
    stream_wait();
    cudaGraphExecDestroy(gr->exec);
    free(gr);
}

/* ---- the device ---- */

static const char *t_device_name(void) { return g.ready ? g.name : ""; }

static kvc_status t_set_option(const char *name, int value) {
    const int most = !strcmp(name, "attention_kernel") ? 2 : 1;
    if (value < 0 || value > most) return fail(KVC_ERR_ARG, "setting %s must be 0 to %d, got %d", name, most, value);
    if (!strcmp(name, "builtin_gemm")) gemm_force_builtin(value);
    else if (!strcmp(name, "attention_kernel")) { /* 0 WMMA, 1 mma.sync, 2 cuDNN (the own kernels where it cannot) */
        KVC_TRY(attention_use_cudnn(value == 2));
        attention_use_mma(value == 1);
    } else return fail(KVC_ERR_ARG, "the CUDA backend has no setting '%s' (builtin_gemm, attention_kernel)", name);
    g_generation++; /* graphs hold the kernels chosen at their capture */
    return KVC_OK;
}

static kvc_status t_check_model(const kvc_config *c) {
    if (c->head_dim % 8 != 0 || c->head_dim > 256)
        return fail(KVC_ERR_UNSUPPORTED, "the CUDA backend needs head_dim to be a multiple of 8, at most 256 (got %d)",
                    c->head_dim);
    return KVC_OK;
}

static void t_memory_stats(int64_t *out) { memory_stats(out); }
static kvc_status t_sync(void) {
    CU_TRY(stream_wait(), "end of call");
    return KVC_OK;
}
static const float *t_host_f32(const kvc_buf *b) { return nullptr; }

/* An entry that fails fast once the context is lost (context_alive): after an illegal address nothing
 * can run or be rolled back, so every later call says so instead of trying. */
template <auto F> struct alive;
template <typename... A, kvc_status (*F)(A...)> struct alive<F> {
    static kvc_status call(A... a) {
        KVC_TRY(context_alive());
        return F(a...);
    }
};

static kvc_backend make_table(void) {
    kvc_backend t;
    memset(&t, 0, sizeof t);
    t.version = KVC_BACKEND_VERSION;
    t.name = "cuda";
    t.device = KVC_DEVICE_CUDA;
    t.act_dtype = KVC_BF16;
    t.weight_dtype = KVC_BF16;
    t.mlp_rows = MLP_ROWS;
    t.serialize = 1;
    t.host_memory = 0;
    t.device_name = t_device_name;
    t.gemm_name = gemm_name;
    t.memory_stats = t_memory_stats;
    t.reset_peak = reset_peak;
    t.sync = alive<t_sync>::call;
    t.set_option = alive<t_set_option>::call;
    t.traffic_stats = traffic_stats;
    t.check_model = alive<t_check_model>::call;
    t.alloc = alive<buf_alloc>::call;
    t.free = buf_free;
    t.upload = alive<buf_upload>::call;
    t.download = alive<buf_download>::call;
    t.host_f32 = t_host_f32;
    t.wrap = nullptr; /* weights live in device memory: the loader copies them */
    t.kv_new = alive<kv_new>::call;
    t.kv_free = kv_free;
    t.kv_commit = kv_commit;
    t.kv_bytes = kv_bytes;
    t.kv_resize = alive<kv_resize>::call;
    t.kv_gather = alive<kv_gather>::call;
    t.kv_set_lens = alive<kv_set_lens>::call;
    t.kv_prune_keys = alive<kv_prune_keys>::call;
    t.kv_write = alive<kv_write>::call;
    t.kv_read = alive<kv_read>::call;
    t.kv_read_heads = alive<kv_read_heads>::call;
    t.kv_write_rows = alive<kv_write_rows>::call;
    t.kv_rows = kv_rows;
    t.kv_keep_rows = alive<kv_keep_rows>::call;
    t.kv_kept_free = kv_kept_free;
    t.embed = alive<t_embed>::call;
    t.rmsnorm = alive<t_rmsnorm>::call;
    t.head_rmsnorm = alive<t_head_rmsnorm>::call;
    t.matmul = alive<t_matmul>::call;
    t.add_bias = alive<t_add_bias>::call;
    t.rope = alive<t_rope>::call;
    t.kv_append = alive<kv_append>::call;
    t.attention = alive<t_attention>::call;
    t.swiglu = alive<t_swiglu>::call;
    t.geglu = alive<t_geglu>::call;
    t.scale = alive<t_scale>::call;
    t.moe_route = alive<t_moe_route>::call;
    t.gather_rows = alive<t_gather_rows>::call;
    t.moe_combine = alive<t_moe_combine>::call;
    t.score = alive<score>::call;
    t.topk = alive<topk>::call;
    t.cos_sum = alive<cos_sum>::call;
    t.bench = alive<k_bench>::call;
    t.graph_capture = alive<t_graph_capture>::call;
    t.graph_launch = alive<t_graph_launch>::call;
    t.graph_free = t_graph_free;
    return t;
}

static const kvc_backend g_table = make_table();

} // namespace kvc

extern "C" __attribute__((visibility("default"))) int32_t kvc_cuda_backend_version(void) { return KVC_BACKEND_VERSION; }

extern "C" __attribute__((visibility("default"))) kvc_status kvc_cuda_backend_open(const kvc_host_services *host,
                                                                                 const kvc_backend **out) {
    *out = nullptr;
    KVC_TRY(kvc::init_with_host(host));
    *out = &kvc::g_table;
    return KVC_OK;
}
