/* cuDNN's fused attention (SDPA) for the CUDA backend's prefill (cudnn_shim.h): built only where the cuDNN and cuDNN
 * frontend headers are (setup.py), opened by the backend at run time. The frontend (header-only) describes the
 * operation; a plan per shape is built once and kept. Each KV head is a batch entry with its own length (the store's
 * device length table), the g query heads of its group the entry's heads, bottom-right causal with a padding mask:
 * the store's rows are ragged, and this call's queries are its last rows. */
#include <cudnn_frontend.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cudnn_shim.h"

namespace fe = cudnn_frontend;

namespace {

enum : int64_t { UID_Q = 1, UID_K, UID_V, UID_O, UID_SEQ_Q, UID_SEQ_KV };

cudnnHandle_t g_handle = nullptr;
std::mutex g_mutex; /* the backend serialises calls; this guards the plan cache anyway */

using Key = std::tuple<int64_t, int64_t, int32_t, int32_t, int32_t, int64_t, int64_t, int64_t, uint32_t>;
struct Plan {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
    int supported = 0;
    std::string why;
};
std::map<Key, Plan> g_plans;

void say(char *why, size_t cap, const std::string &s) {
    if (why && cap) std::snprintf(why, cap, "%s", s.c_str());
}

Plan build(const kvc_cudnn_sdpa_args &a) {
    Plan p;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const int64_t B = a.Hkv, G = a.g, N = a.n, S = a.max_kv, D = a.d;
    auto Q = g->tensor(fe::graph::Tensor_attributes().set_name("Q").set_uid(UID_Q).set_dim({B, G, N, D}).set_stride(
        {G * D, D, a.ldq, 1}));
    auto K = g->tensor(fe::graph::Tensor_attributes().set_name("K").set_uid(UID_K).set_dim({B, 1, S, D}).set_stride(
        {a.head_stride, a.head_stride, D, 1}));
    auto V = g->tensor(fe::graph::Tensor_attributes().set_name("V").set_uid(UID_V).set_dim({B, 1, S, D}).set_stride(
        {a.head_stride, a.head_stride, D, 1}));
    auto sq = g->tensor(fe::graph::Tensor_attributes().set_name("seq_q").set_uid(UID_SEQ_Q).set_dim({B, 1, 1, 1})
                            .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
    auto skv = g->tensor(fe::graph::Tensor_attributes().set_name("seq_kv").set_uid(UID_SEQ_KV).set_dim({B, 1, 1, 1})
                             .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("kvc_prefill")
                    .set_generate_stats(false)
                    .set_attn_scale(a.scale)
                    .set_causal_mask_bottom_right(true)
                    .set_padding_mask(true)
                    .set_seq_len_q(sq)
                    .set_seq_len_kv(skv);
    auto out = g->sdpa(Q, K, V, opts);
    out[0]->set_output(true).set_uid(UID_O).set_dim({B, G, N, D}).set_stride({G * D, D, a.ldo, 1});
    auto steps = [&]() -> fe::error_t { /* the first failure, or success */
        if (auto r = g->validate(); r.is_bad()) return r;
        if (auto r = g->build_operation_graph(g_handle); r.is_bad()) return r;
        if (auto r = g->create_execution_plans({fe::HeurMode_t::A}); r.is_bad()) return r;
        if (auto r = g->check_support(g_handle); r.is_bad()) return r;
        if (auto r = g->build_plans(g_handle); r.is_bad()) return r;
        return g->get_workspace_size(p.workspace);
    };
    fe::error_t e = steps();
    if (e.is_bad()) {
        p.why = "cuDNN has no attention plan for n " + std::to_string(N) + ", KV rows " + std::to_string(S) +
                ", head dim " + std::to_string(D) + ": " + e.get_message();
        return p;
    }
    p.graph = g;
    p.supported = 1;
    return p;
}

} // namespace

extern "C" __attribute__((visibility("default"))) int32_t kvc_cudnn_shim_version(void) { return KVC_CUDNN_SHIM_VERSION; }

extern "C" __attribute__((visibility("default"))) int kvc_cudnn_shim_open(void *stream, char *why, size_t why_cap) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_handle) return KVC_CUDNN_OK;
    cudnnHandle_t h = nullptr;
    cudnnStatus_t st = cudnnCreate(&h);
    if (st == CUDNN_STATUS_SUCCESS) st = cudnnSetStream(h, (cudaStream_t)stream);
    if (st != CUDNN_STATUS_SUCCESS) {
        say(why, why_cap, std::string("cuDNN did not start: ") + cudnnGetErrorString(st));
        if (h) cudnnDestroy(h);
        return KVC_CUDNN_ERROR;
    }
    g_handle = h;
    return KVC_CUDNN_OK;
}

extern "C" __attribute__((visibility("default"))) int kvc_cudnn_shim_sdpa(const kvc_cudnn_sdpa_args *a, void *ws,
                                                                        size_t ws_bytes, size_t *ws_need, char *why,
                                                                        size_t why_cap) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_handle) {
        say(why, why_cap, "cuDNN attention called before kvc_cudnn_shim_open");
        return KVC_CUDNN_ERROR;
    }
    try {
        uint32_t sbits;
        std::memcpy(&sbits, &a->scale, sizeof sbits);
        const Key key{a->n, a->max_kv, a->Hkv, a->g, a->d, a->ldq, a->ldo, a->head_stride, sbits};
        auto it = g_plans.find(key);
        if (it == g_plans.end()) {
            if (g_plans.size() >= 64) g_plans.clear(); /* prefill chunk shapes vary; plans are cheap to rebuild */
            it = g_plans.emplace(key, build(*a)).first;
        }
        const Plan &p = it->second;
        if (!p.supported) {
            say(why, why_cap, p.why);
            return KVC_CUDNN_UNSUPPORTED;
        }
        if ((size_t)p.workspace > ws_bytes) {
            *ws_need = (size_t)p.workspace;
            return KVC_CUDNN_NEED_WORKSPACE;
        }
        if (cudnnSetStream(g_handle, (cudaStream_t)a->stream) != CUDNN_STATUS_SUCCESS) {
            say(why, why_cap, "cuDNN: setting the stream failed");
            return KVC_CUDNN_ERROR;
        }
        std::unordered_map<int64_t, void *> pack = {
            {UID_Q, const_cast<void *>(a->q)},          {UID_K, const_cast<void *>(a->k)},
            {UID_V, const_cast<void *>(a->v)},          {UID_O, a->o},
            {UID_SEQ_Q, const_cast<int32_t *>(a->seq_q)}, {UID_SEQ_KV, const_cast<int32_t *>(a->seq_kv)}};
        fe::error_t e = p.graph->execute(g_handle, pack, ws);
        if (e.is_bad()) {
            say(why, why_cap, "cuDNN attention failed: " + e.get_message());
            return KVC_CUDNN_ERROR;
        }
        return KVC_CUDNN_OK;
    } catch (const std::exception &ex) {
        say(why, why_cap, std::string("cuDNN attention failed: ") + ex.what());
        return KVC_CUDNN_ERROR;
    }
}
