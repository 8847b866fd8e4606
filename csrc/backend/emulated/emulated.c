/* The emulated device: the CUDA backend's contract on the CPU, so that CI runs every host-side line of
 * the device path (docs/ARCHITECTURE.md, "Backends").
 *
 * - Buffers are separate allocations reached only through upload, download and the kernels.
 * - Storage rounds where the CUDA backend stores bf16: weight matrices, activations (normed x, q|k|v,
 *   attention output, o, gate|up) and the K/V cache; the residual stream, norm weights, biases, scores
 *   and logits stay f32. Kernels compute in fp32 (the CPU kernels on converted copies). Not emulated:
 *   the rounding of softmax probabilities inside the device's attention kernels, and its summation order.
 * - Calls from several threads take turns, as on the device's one stream.
 * - Graphs: a capture records the kernel calls (their arguments by value, as a CUDA graph bakes kernel
 *   parameters) without running them; a launch replays the record. Work that read a host value at
 *   capture time replays that stale value here exactly as it would on the GPU, and a replay over a buffer
 *   that moved since the capture is an error (the CUDA graph would read freed memory).
 * - Faults on demand (set_option "fail_after" n): the (n+1)-th device operation from then on fails
 *   once with KVC_ERR_DEVICE, as a CUDA error would, so tests can fail a call at every point and check
 *   that it loses nothing.
 * - Host-device traffic is counted (traffic_stats) as the CUDA backend moves it at each entry: a copy between
 *   host and device memory is a transfer, a wait for the stream a sync; the K/V entries' length checks and
 *   table uploads and the graphs' waits included, the waits of frees aside. Tests assert the counts a layer's press
 *   work takes. */
#include <stdlib.h>
#include <string.h>

#include "../cpu/host.h"

static kvc_host_stats g_stats;

/* ---- host-device traffic, as the CUDA backend moves it (calls are serialised) ---- */

static int64_t g_traffic[KVC_XFER_N];

static void traffic(int64_t downs, int64_t ups, int64_t syncs, int64_t down_bytes, int64_t up_bytes) {
    g_traffic[KVC_XFER_DOWNLOADS] += downs;
    g_traffic[KVC_XFER_UPLOADS] += ups;
    g_traffic[KVC_XFER_SYNCS] += syncs;
    g_traffic[KVC_XFER_DOWN_BYTES] += down_bytes;
    g_traffic[KVC_XFER_UP_BYTES] += up_bytes;
}
static void emu_traffic(int64_t *out, int reset) {
    memcpy(out, g_traffic, sizeof g_traffic);
    if (reset) memset(g_traffic, 0, sizeof g_traffic);
}
/* the K/V entries read the device's lengths first (the CUDA store checks rows against them) */
static void traffic_lens(const kvc_kv *kv) { traffic(1, 0, 1, (int64_t)sizeof(int32_t) * kv->Hkv, 0); }
/* and upload the store's tables (head pointers twice, lengths) after a layout change */
static void traffic_tables(const kvc_kv *kv) {
    traffic(0, 3, 1, 0, (int64_t)(2 * sizeof(void *) + sizeof(int32_t)) * kv->Hkv);
}

/* ---- injected faults (calls are serialised: the core holds the device's lock) ---- */

static int64_t g_fault_in = -1; /* device operations left before the injected fault; -1: none */

static kvc_status fault(const char *what) {
    if (g_fault_in < 0 || g_fault_in-- > 0) return KVC_OK;
    return kvc_fail(KVC_ERR_DEVICE, "emulated device: injected fault in %s (set_device_option 'fail_after')", what);
}

/* ---- graph recording ---- */

enum {
    OP_EMBED, OP_RMSNORM, OP_MATMUL, OP_BIAS, OP_ROPE, OP_APPEND, OP_ATTENTION, OP_SWIGLU, OP_HEAD_NORM, OP_GEGLU, OP_SCALE,
    OP_COMMIT, OP_MOE_ROUTE, OP_GATHER_ROWS, OP_MOE_COMBINE
};

typedef struct op {
    int32_t kind, has_add;
    kvc_view v[4];
    void *p[4];      /* v[i].buf->p at capture time */
    kvc_kv *kv;
    int64_t i[4];
    int32_t j[3];
    float f, f2;
} op;

struct kvc_graph {
    op *ops;
    size_t n, cap;
};

static _Thread_local kvc_graph *g_rec; /* the graph being captured on this thread, or NULL */
static _Thread_local kvc_status g_rec_st;

/* Record op when capturing (returns 1), else 0: the caller runs it. */
static int record(op o) {
    if (!g_rec) return 0;
    if (g_rec_st != KVC_OK) return 1;
    if (g_rec->n == g_rec->cap) {
        const size_t cap = g_rec->cap ? 2 * g_rec->cap : 64;
        op *p = realloc(g_rec->ops, cap * sizeof *p);
        if (!p) {
            g_rec_st = kvc_fail(KVC_ERR_NOMEM, "out of memory: graph capture");
            return 1;
        }
        g_rec->ops = p;
        g_rec->cap = cap;
    }
    for (int k = 0; k < 4; k++) o.p[k] = o.v[k].buf ? o.v[k].buf->p : NULL;
    g_rec->ops[g_rec->n++] = o;
    return 1;
}

static kvc_status run_op(const op *o) {
    static const char *const names[] = {"embed", "rmsnorm", "matmul", "add_bias", "rope", "kv_append", "attention", "swiglu",
                                        "head_rmsnorm", "geglu", "scale", "kv_commit", "moe_route", "gather_rows", "moe_combine"};
    KVC_TRY(fault(o->kind >= 0 && o->kind <= OP_MOE_COMBINE ? names[o->kind] : "a kernel"));
    switch (o->kind) {
    case OP_EMBED: return kvc_host_embed(o->v[0], o->v[1], o->i[0], o->i[1], o->v[2]);
    case OP_RMSNORM: return kvc_host_rmsnorm_v(o->v[0], o->has_add ? &o->v[3] : NULL, o->v[1], o->v[2], o->i[0], o->i[1], o->f);
    case OP_MATMUL: return kvc_host_matmul_v(o->v[0], o->v[1], o->v[2], o->i[0], o->i[1], o->i[2], o->j[0]);
    case OP_BIAS: return kvc_host_add_bias_v(o->v[0], o->v[1], o->i[0], o->i[1]);
    case OP_ROPE: return kvc_host_rope_v(o->v[0], o->i[0], o->i[1], o->j[0], o->j[1], o->v[1], o->v[2], o->j[2], o->f);
    case OP_APPEND: return kvc_hkv_append(o->kv, o->v[0], o->i[0], o->i[1], o->i[2]);
    case OP_ATTENTION: return kvc_host_attention_v(o->v[0], o->i[0], o->j[0], o->kv, o->f, o->f2, o->v[2], o->v[1], o->j[1]);
    case OP_SWIGLU: return kvc_host_swiglu_v(o->v[0], o->i[0], o->i[1]);
    case OP_HEAD_NORM: return kvc_host_head_rmsnorm_v(o->v[0], o->i[0], o->i[1], o->j[0], o->j[1], o->v[1], o->f);
    case OP_GEGLU: return kvc_host_geglu_v(o->v[0], o->i[0], o->i[1]);
    case OP_SCALE: return kvc_host_scale_v(o->v[0], o->i[0], o->i[1], o->f);
    case OP_COMMIT: return kvc_hkv_commit(o->kv);
    case OP_MOE_ROUTE: return kvc_host_moe_route_v(o->v[0], o->i[0], o->j[0], o->j[1], o->j[2], o->v[1], o->v[2]);
    case OP_GATHER_ROWS: return kvc_host_gather_rows_v(o->v[0], o->v[1], o->i[0], o->i[1], o->v[2]);
    case OP_MOE_COMBINE: return kvc_host_moe_combine_v(o->v[0], o->v[1], o->v[2], o->v[3], o->i[0], o->j[0], o->i[1]);
    default: return kvc_fail(KVC_ERR_INTERNAL, "graph: unknown op %d", o->kind);
    }
}

static kvc_status emu_graph_capture(kvc_graph **g, kvc_status (*run)(void *), void *user) {
    if (g_rec) return kvc_fail(KVC_ERR_INTERNAL, "graph capture inside a capture");
    traffic(0, 0, 1, 0, 0); /* CUDA waits for the stream before it captures */
    kvc_graph *ng = calloc(1, sizeof *ng);
    if (!ng) return kvc_fail(KVC_ERR_NOMEM, "out of memory: graph");
    g_rec = ng;
    g_rec_st = KVC_OK;
    kvc_status st = run(user);
    g_rec = NULL;
    if (st == KVC_OK) st = g_rec_st;
    if (st != KVC_OK) {
        free(ng->ops);
        free(ng);
        return st;
    }
    if (*g) {
        free((*g)->ops);
        free(*g);
    }
    *g = ng;
    return KVC_OK;
}

static kvc_status emu_graph_launch(kvc_graph *g) {
    traffic(0, 0, 1, 0, 0); /* the replay is waited for */
    for (size_t i = 0; i < g->n; i++) {
        const op *o = &g->ops[i];
        for (int k = 0; k < 4; k++)
            if (o->v[k].buf && o->v[k].buf->p != o->p[k])
                return kvc_fail(KVC_ERR_INTERNAL, "graph replay: a buffer of op %zu moved since the capture", i);
        KVC_TRY(run_op(o));
    }
    return KVC_OK;
}

static void emu_graph_free(kvc_graph *g) {
    if (!g) return;
    free(g->ops);
    free(g);
}

/* ---- the kernels: recorded while capturing, else run ---- */

static kvc_status emu_embed(kvc_view table, kvc_view ids, int64_t n, int64_t D, kvc_view x) {
    op o = {.kind = OP_EMBED, .v = {table, ids, x}, .i = {n, D}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_rmsnorm(kvc_view x, const kvc_view *add, kvc_view w, kvc_view y, int64_t rows, int64_t D, float eps) {
    op o = {.kind = OP_RMSNORM, .has_add = add != NULL, .v = {x, w, y}, .i = {rows, D}, .f = eps};
    if (add) o.v[3] = *add;
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_matmul(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate) {
    op o = {.kind = OP_MATMUL, .v = {a, w, c}, .i = {m, n, k}, .j = {accumulate}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_add_bias(kvc_view y, kvc_view b, int64_t rows, int64_t dim) {
    op o = {.kind = OP_BIAS, .v = {y, b}, .i = {rows, dim}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_rope(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view pos, kvc_view inv_freq,
                           int32_t pairing, float mscale) {
    op o = {.kind = OP_ROPE, .v = {x, pos, inv_freq}, .i = {col0, n}, .j = {heads, d, pairing}, .f = mscale};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_kv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n) {
    op o = {.kind = OP_APPEND, .v = {src}, .kv = kv, .i = {kcol, vcol, n}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_kv_commit(kvc_kv *kv) {
    if (kv->direct) return KVC_OK; /* bf16 rows stored as they come: nothing to do, nothing recorded */
    op o = {.kind = OP_COMMIT, .kv = kv};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_head_rmsnorm(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view w, float eps) {
    op o = {.kind = OP_HEAD_NORM, .v = {x, w}, .i = {col0, n}, .j = {heads, d}, .f = eps};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_attention(kvc_view q, int64_t n, int32_t H, kvc_kv *kv, float scale, float softcap, kvc_view start,
                                kvc_view out, int32_t flags) {
    op o = {.kind = OP_ATTENTION, .v = {q, out, start}, .kv = kv, .i = {n}, .j = {H, flags}, .f = scale, .f2 = softcap};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_swiglu(kvc_view gu, int64_t rows, int64_t F) {
    op o = {.kind = OP_SWIGLU, .v = {gu}, .i = {rows, F}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_geglu(kvc_view gu, int64_t rows, int64_t F) {
    op o = {.kind = OP_GEGLU, .v = {gu}, .i = {rows, F}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_scale(kvc_view x, int64_t rows, int64_t cols, float alpha) {
    op o = {.kind = OP_SCALE, .v = {x}, .i = {rows, cols}, .f = alpha};
    return record(o) ? KVC_OK : run_op(&o);
}

static kvc_status emu_moe_route(kvc_view logits, int64_t n, int32_t E, int32_t k, int32_t norm, kvc_view ids, kvc_view w) {
    op o = {.kind = OP_MOE_ROUTE, .v = {logits, ids, w}, .i = {n}, .j = {E, k, norm}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_gather_rows(kvc_view src, kvc_view idx, int64_t n, int64_t D, kvc_view dst) {
    op o = {.kind = OP_GATHER_ROWS, .v = {src, idx, dst}, .i = {n, D}};
    return record(o) ? KVC_OK : run_op(&o);
}
static kvc_status emu_moe_combine(kvc_view x, kvc_view y, kvc_view w, kvc_view pos, int64_t n, int32_t k, int64_t D) {
    op o = {.kind = OP_MOE_COMBINE, .v = {x, y, w, pos}, .i = {n, D}, .j = {k}};
    return record(o) ? KVC_OK : run_op(&o);
}

/* Work that cannot be part of a graph (it reads or writes host memory) is refused during a capture. */
#define NOT_IN_GRAPH(what)                                                            \
    do {                                                                              \
        if (g_rec) return kvc_fail(KVC_ERR_INTERNAL, "%s during a graph capture", what); \
        KVC_TRY(fault(what));                                                         \
    } while (0)

static kvc_status emu_upload(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t t) {
    NOT_IN_GRAPH("upload");
    KVC_TRY(kvc_hbuf_upload(dst, rows, cols, src, t));
    /* bf16 goes through device staging (no wait); other dtypes wait for the caller's pageable memory */
    if (rows > 0 && cols > 0) traffic(0, 1, dst.buf->dtype != KVC_BF16, 0, rows * cols * (int64_t)kvc_dtype_size(t));
    return KVC_OK;
}
static kvc_status emu_download(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t t) {
    NOT_IN_GRAPH("download");
    KVC_TRY(kvc_hbuf_download(src, rows, cols, dst, t));
    if (rows > 0 && cols > 0) traffic(1, 0, 1, rows * cols * (int64_t)kvc_dtype_size(t), 0);
    return KVC_OK;
}
static kvc_status emu_score(const kvc_score_args *a) {
    NOT_IN_GRAPH("scoring");
    return kvc_host_score_v(a);
}
static kvc_status emu_topk(kvc_view s, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep) {
    NOT_IN_GRAPH("top-k");
    KVC_TRY(kvc_host_topk_v(s, heads, len, k, keep));
    for (int32_t h = 0; h < heads; h++) /* each head's rows come back on their own */
        if (k[h] > 0) traffic(1, 0, 1, k[h] * (int64_t)sizeof(int32_t), 0);
    return KVC_OK;
}
static kvc_status emu_cos_sum(kvc_view r, kvc_view o, int64_t rows, int64_t D, double *out) {
    NOT_IN_GRAPH("cos_sum");
    KVC_TRY(kvc_host_cos_sum_v(r, o, rows, D, out));
    traffic(1, 0, 1, (int64_t)sizeof(double), 0);
    return KVC_OK;
}

static kvc_status emu_kv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src) {
    NOT_IN_GRAPH("a K/V resize");
    KVC_TRY(kvc_hkv_resize(kv, cap, rows, src));
    traffic_lens(src ? src : kv);
    traffic(0, 0, 1, 0, 0); /* the copies' end */
    traffic_tables(kv);
    return KVC_OK;
}
static kvc_status emu_kv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap) {
    NOT_IN_GRAPH("a K/V compaction");
    KVC_TRY(kvc_hkv_gather(kv, keep, n_keep, cap));
    int64_t total = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) total += n_keep[h];
    traffic_lens(kv);
    traffic(0, 1, 2, 0, total * (int64_t)sizeof(int32_t)); /* the kept rows' indices; the copies' end, the call's */
    traffic_tables(kv);
    return KVC_OK;
}
static kvc_status emu_kv_set_lens(kvc_kv *kv, const int64_t *len) {
    NOT_IN_GRAPH("setting K/V lengths");
    KVC_TRY(kvc_hkv_set_lens(kv, len));
    traffic_tables(kv);
    return KVC_OK;
}
static kvc_status emu_kv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    NOT_IN_GRAPH("a K/V key-channel pruning");
    return kvc_hkv_prune_keys(kv, dk, kidx);
}
static kvc_status emu_kv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v) {
    NOT_IN_GRAPH("a K/V write");
    KVC_TRY(kvc_hkv_write(kv, h, row0, rows, k, v));
    const int64_t passes = (k != NULL) + (v != NULL), bytes = rows * kv->d * (int64_t)sizeof(float);
    if (rows > 0) traffic(0, passes, passes, 0, passes * bytes); /* K, then V: a copy and a wait each */
    return KVC_OK;
}
static kvc_status emu_kv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v) {
    NOT_IN_GRAPH("a K/V read");
    KVC_TRY(kvc_hkv_read(kv, h, row0, rows, k, v));
    const int64_t passes = (k != NULL) + (v != NULL), bytes = rows * kv->d * (int64_t)sizeof(float);
    traffic_lens(kv);
    if (rows > 0) traffic(passes, 0, passes, passes * bytes, 0);
    return KVC_OK;
}
/* the batched entries: one copy through a pinned staging buffer and one wait for the whole layer */
static kvc_status emu_kv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    NOT_IN_GRAPH("a K/V read");
    KVC_TRY(kvc_hkv_read_heads(kv, row0, rows, k, v));
    int64_t total = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) total += rows[h];
    traffic_lens(kv);
    if (total > 0 && (k || v)) traffic(1, 0, 1, total * kv->d * (int64_t)sizeof(float) * ((k != NULL) + (v != NULL)), 0);
    return KVC_OK;
}
static kvc_status emu_kv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v) {
    NOT_IN_GRAPH("a K/V write");
    KVC_TRY(kvc_hkv_write_rows(kv, idx, n, k, v));
    int64_t total = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) total += n[h];
    const int64_t row_bytes = kv->d * (int64_t)sizeof(float) * ((k != NULL) + (v != NULL)) + (int64_t)sizeof(int32_t);
    if (total > 0 && (k || v)) traffic(0, 1, 1, 0, total * row_bytes); /* the rows with their indices */
    return KVC_OK;
}

/* rows lent in place: host memory here, as the CUDA store lends device pointers (no traffic); keeping them copies the
 * arena on the device and uploads the store's tables */
static kvc_status emu_kv_keep_rows(kvc_kv *kv, void **kept) {
    NOT_IN_GRAPH("keeping lent K/V rows");
    KVC_TRY(kvc_hkv_keep_rows(kv, kept));
    traffic(0, 0, 1, 0, 0); /* the copies' end */
    traffic_tables(kv);
    return KVC_OK;
}

/* ---- the rest of the table ---- */

static const char *emu_name(void) { return "emulated device (bf16 storage on the CPU)"; }
static const char *emu_gemm(void) { return "cpu kernels on bf16-rounded operands"; }
static void emu_memory(int64_t *out) { kvc_host_stats_read(&g_stats, out); }
static void emu_reset_peak(void) { kvc_host_stats_reset_peak(&g_stats); }
/* nothing is asynchronous here; the entry exists so the engine's end-of-call path runs as on a device */
static kvc_status emu_sync(void) {
    KVC_TRY(fault("sync"));
    traffic(0, 0, 1, 0, 0);
    return KVC_OK;
}
static kvc_status emu_option(const char *name, int value) {
    if (!strcmp(name, "fail_after")) {
        g_fault_in = value < 0 ? -1 : value;
        return KVC_OK;
    }
    /* the CUDA backend's settings, accepted so the same tests run here; one set of kernels underneath */
    if ((!strcmp(name, "builtin_gemm") || !strcmp(name, "attention_kernel")) && (value == 0 || value == 1)) return KVC_OK;
    if (!strcmp(name, "attention_kernel") && value == 2) /* as CUDA answers where cuDNN cannot load */
        return kvc_fail(KVC_ERR_UNSUPPORTED, "cuDNN attention is not available: the emulated device runs the CPU kernels");
    return kvc_fail(KVC_ERR_ARG, "unknown setting '%s' = %d for the emulated device", name, value);
}
static kvc_status emu_alloc(int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out) {
    *out = NULL;
    KVC_TRY(fault(what));
    return kvc_hbuf_alloc(&g_stats, dtype, n, cat, what, out);
}
static const float *emu_host_f32(const kvc_buf *b) { (void)b; return NULL; /* device memory: never read in place */ }
static kvc_status emu_kv_new(int32_t Hkv, int32_t d, const kvc_kv_format *fmt, kvc_kv **out) {
    *out = NULL;
    KVC_TRY(fault("kv_new"));
    return kvc_hkv_new(&g_stats, KVC_BF16, fmt, Hkv, d, out);
}

static const kvc_backend g_emulated = {
    .version = KVC_BACKEND_VERSION,
    .name = "emulated",
    .device = KVC_DEVICE_EMULATED,
    .act_dtype = KVC_BF16,
    .weight_dtype = KVC_BF16,
    .mlp_rows = 8192, /* as the CUDA backend */
    .serialize = 1,
    .host_memory = 1, /* device memory by contract, lent to DLPack as host memory (kDLCPU) */
    .device_name = emu_name,
    .gemm_name = emu_gemm,
    .memory_stats = emu_memory,
    .reset_peak = emu_reset_peak,
    .sync = emu_sync,
    .set_option = emu_option,
    .traffic_stats = emu_traffic,
    .alloc = emu_alloc,
    .free = kvc_hbuf_free,
    .upload = emu_upload,
    .download = emu_download,
    .host_f32 = emu_host_f32,
    .wrap = NULL, /* device memory, as on CUDA: the loader copies the weights */
    .kv_new = emu_kv_new,
    .kv_commit = emu_kv_commit,
    .kv_free = kvc_hkv_free,
    .kv_bytes = kvc_hkv_bytes,
    .kv_resize = emu_kv_resize,
    .kv_gather = emu_kv_gather,
    .kv_set_lens = emu_kv_set_lens,
    .kv_prune_keys = emu_kv_prune_keys,
    .kv_write = emu_kv_write,
    .kv_read = emu_kv_read,
    .kv_read_heads = emu_kv_read_heads,
    .kv_write_rows = emu_kv_write_rows,
    .kv_rows = kvc_hkv_rows,
    .kv_keep_rows = emu_kv_keep_rows,
    .kv_kept_free = kvc_hkv_kept_free,
    .embed = emu_embed,
    .rmsnorm = emu_rmsnorm,
    .matmul = emu_matmul,
    .add_bias = emu_add_bias,
    .rope = emu_rope,
    .kv_append = emu_kv_append,
    .head_rmsnorm = emu_head_rmsnorm,
    .attention = emu_attention,
    .swiglu = emu_swiglu,
    .geglu = emu_geglu,
    .scale = emu_scale,
    .moe_route = emu_moe_route,
    .gather_rows = emu_gather_rows,
    .moe_combine = emu_moe_combine,
    .score = emu_score,
    .topk = emu_topk,
    .cos_sum = emu_cos_sum,
    .graph_capture = emu_graph_capture,
    .graph_launch = emu_graph_launch,
    .graph_free = emu_graph_free,
};

const kvc_backend *kvc_backend_emulated(void) { return &g_emulated; }
