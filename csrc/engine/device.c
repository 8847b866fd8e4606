/* The public device API: what a device is and holds (kvc_device_*), and its kernels on host arrays
 * through its table, for tests that compare a device with the CPU reference and for benchmarks. Written
 * once for every backend: host arrays are uploaded into buffers of the backend's own dtypes (rounded as
 * it stores them), the kernel runs, the result comes back as fp32. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/backend.h"
#include "../core/common.h"

int kvc_device_available(int32_t device) {
    const kvc_backend *be;
    return kvc_backend_get(device, &be) == KVC_OK;
}

kvc_status kvc_device_init(int32_t device) {
    const kvc_backend *be;
    return kvc_backend_get(device, &be);
}

const char *kvc_device_name(int32_t device) {
    const kvc_backend *be;
    return kvc_backend_get(device, &be) == KVC_OK ? be->device_name() : "";
}

const char *kvc_device_gemm_name(int32_t device) {
    const kvc_backend *be;
    return kvc_backend_get(device, &be) == KVC_OK ? be->gemm_name() : "";
}

kvc_status kvc_device_memory_stats(int32_t device, int64_t *out) {
    const kvc_backend *be;
    if (!out) return kvc_fail(KVC_ERR_ARG, "memory_stats: out is NULL");
    KVC_TRY(kvc_backend_get(device, &be));
    be->memory_stats(out);
    return KVC_OK;
}

kvc_status kvc_device_reset_peak(int32_t device) {
    const kvc_backend *be;
    KVC_TRY(kvc_backend_get(device, &be));
    be->reset_peak();
    return KVC_OK;
}

kvc_status kvc_device_traffic(int32_t device, int32_t reset, int64_t *out) {
    const kvc_backend *be;
    if (!out) return kvc_fail(KVC_ERR_ARG, "device traffic: out is NULL");
    KVC_TRY(kvc_backend_get(device, &be));
    if (!be->traffic_stats) return kvc_fail(KVC_ERR_UNSUPPORTED, "the %s backend has no host-device traffic to count", be->name);
    kvc_backend_lock(be);
    be->traffic_stats(out, reset != 0);
    kvc_backend_unlock(be);
    return KVC_OK;
}

kvc_status kvc_device_set_option(int32_t device, const char *name, int32_t value) {
    const kvc_backend *be;
    if (!name) return kvc_fail(KVC_ERR_ARG, "set_option: name is NULL");
    KVC_TRY(kvc_backend_get(device, &be));
    kvc_backend_lock(be);
    kvc_status st = be->set_option(name, value);
    kvc_backend_unlock(be);
    return st;
}

kvc_status kvc_device_bench(int32_t device, int32_t what, const int64_t *dims, int32_t reps, double *seconds) {
    const kvc_backend *be;
    if (!dims || !seconds) return kvc_fail(KVC_ERR_ARG, "bench: null argument");
    if (what != 0 && what != 1) return kvc_fail(KVC_ERR_ARG, "bench: unknown kernel %d (0: GEMM, 1: prefill attention)", what);
    for (int i = 0; i < (what == 1 ? 4 : 3); i++)
        if (dims[i] <= 0 || dims[i] >= (1LL << 31)) return kvc_fail(KVC_ERR_ARG, "bench: dimension %d out of range", i);
    KVC_TRY(kvc_backend_get(device, &be));
    if (!be->bench) return kvc_fail(KVC_ERR_UNSUPPORTED, "the %s backend has no device timers", be->name);
    kvc_backend_lock(be);
    kvc_status st = be->bench(what, dims, reps, seconds);
    kvc_backend_unlock(be);
    return st;
}

/* ---- kernels on host arrays ---------------------------------------------------------------------------- */

#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) return kvc_fail(KVC_ERR_ARG, __VA_ARGS__); \
    } while (0)

/* Buffers of one call, freed at the end whatever happened. */
typedef struct scope {
    const kvc_backend *be;
    kvc_buf *b[8];
    int n;
    kvc_kv *kv;
} scope;

static kvc_status scope_buf(scope *sc, int32_t dtype, int64_t n, const void *src, int64_t rows, int64_t cols, int32_t src_t,
                            kvc_buf **out) {
    KVC_TRY(sc->be->alloc(dtype, n > 0 ? n : 1, KVC_MEM_ACT, "kernel test buffer", out));
    sc->b[sc->n++] = *out;
    if (src) KVC_TRY(sc->be->upload(kvc_view_of(*out, 0, cols), rows, cols, src, src_t));
    return KVC_OK;
}

static void scope_end(scope *sc) {
    for (int i = 0; i < sc->n; i++) sc->be->free(sc->b[i]);
    if (sc->kv) sc->be->kv_free(sc->kv);
    kvc_backend_unlock(sc->be);
}

static kvc_status scope_begin(scope *sc, int32_t device) {
    memset(sc, 0, sizeof *sc);
    KVC_TRY(kvc_backend_get(device, &sc->be));
    kvc_backend_lock(sc->be);
    return KVC_OK;
}

kvc_status kvc_device_kernel_matmul(int32_t device, const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    CHECK(a && b && c, "matmul: a, b and c must not be NULL");
    CHECK(m > 0 && n > 0 && k > 0, "matmul: sizes must be positive (m=%lld n=%lld k=%lld)", (long long)m, (long long)n,
          (long long)k);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *A, *B, *C;
    kvc_status st = scope_buf(&sc, sc.be->act_dtype, m * k, a, m, k, KVC_F32, &A);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->weight_dtype, n * k, b, n, k, KVC_F32, &B);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, m * n, NULL, 0, 0, 0, &C);
    if (st == KVC_OK) st = sc.be->matmul(kvc_view_of(A, 0, k), kvc_view_of(B, 0, k), kvc_view_of(C, 0, n), m, n, k, 0);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(C, 0, n), m, n, c, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_rmsnorm(int32_t device, const float *x, const float *r, const float *w, float *y, float *x_out,
                                     int64_t rows, int64_t dim, float eps) {
    CHECK(x && w && y, "rmsnorm: x, w and y must not be NULL");
    CHECK(rows > 0 && dim > 0, "rmsnorm: sizes must be positive (rows=%lld dim=%lld)", (long long)rows, (long long)dim);
    CHECK(eps > 0 && isfinite(eps), "rmsnorm: eps must be finite and > 0 (got %g)", (double)eps);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *X, *R = NULL, *W, *Y;
    kvc_status st = scope_buf(&sc, KVC_F32, rows * dim, x, rows, dim, KVC_F32, &X);
    if (st == KVC_OK && r) st = scope_buf(&sc, sc.be->act_dtype, rows * dim, r, rows, dim, KVC_F32, &R);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, dim, w, 1, dim, KVC_F32, &W);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->act_dtype, rows * dim, NULL, 0, 0, 0, &Y);
    const kvc_view rv = kvc_view_of(R, 0, dim);
    if (st == KVC_OK)
        st = sc.be->rmsnorm(kvc_view_of(X, 0, dim), R ? &rv : NULL, kvc_view_of(W, 0, dim), kvc_view_of(Y, 0, dim), rows, dim, eps);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(Y, 0, dim), rows, dim, y, KVC_F32);
    if (st == KVC_OK && x_out) st = sc.be->download(kvc_view_of(X, 0, dim), rows, dim, x_out, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_rope(int32_t device, float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d,
                                  const float *inv_freq, int32_t pairing) {
    CHECK(x && pos && inv_freq, "rope: x, pos and inv_freq must not be NULL");
    CHECK(n > 0 && heads > 0, "rope: sizes must be positive (n=%lld heads=%d)", (long long)n, heads);
    CHECK(d >= 2 && d % 2 == 0 && d <= 1024, "rope: head_dim must be even and in [2, 1024] (got %d)", d);
    CHECK(pairing == KVC_ROPE_HALF || pairing == KVC_ROPE_ADJACENT, "rope: pairing must be 0 or 1, got %d", pairing);
    for (int64_t i = 0; i < n; i++) CHECK(pos[i] >= 0, "rope: position %lld is negative", (long long)i);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    const int64_t w = (int64_t)heads * d;
    kvc_buf *X, *P, *F;
    kvc_status st = scope_buf(&sc, sc.be->act_dtype, n * w, x, n, w, KVC_F32, &X);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_I64, n, pos, 1, n, KVC_I64, &P);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, d / 2, inv_freq, 1, d / 2, KVC_F32, &F);
    if (st == KVC_OK)
        st = sc.be->rope(kvc_view_of(X, 0, w), 0, n, heads, d, kvc_view_of(P, 0, n), kvc_view_of(F, 0, d / 2), pairing, 1.0f);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(X, 0, w), n, w, x, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_swiglu(int32_t device, const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    CHECK(gate && up && out, "swiglu: gate, up and out must not be NULL");
    CHECK(rows > 0 && dim > 0, "swiglu: sizes must be positive (rows=%lld dim=%lld)", (long long)rows, (long long)dim);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *G;
    kvc_status st = scope_buf(&sc, sc.be->act_dtype, rows * 2 * dim, NULL, 0, 0, 0, &G);
    const kvc_view gu = kvc_view_of(G, 0, 2 * dim);
    if (st == KVC_OK) st = sc.be->upload(gu, rows, dim, gate, KVC_F32);
    if (st == KVC_OK) st = sc.be->upload(kvc_view_at(gu, 0, dim), rows, dim, up, KVC_F32);
    if (st == KVC_OK) st = sc.be->swiglu(gu, rows, dim);
    if (st == KVC_OK) st = sc.be->download(gu, rows, dim, out, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_head_rmsnorm(int32_t device, float *x, int64_t n, int32_t heads, int32_t d, const float *w,
                                          float eps) {
    CHECK(x && w, "head_rmsnorm: x and w must not be NULL");
    CHECK(n > 0 && heads > 0 && d > 0, "head_rmsnorm: sizes must be positive (n=%lld heads=%d d=%d)", (long long)n, heads, d);
    CHECK(eps > 0 && isfinite(eps), "head_rmsnorm: eps must be finite and > 0 (got %g)", (double)eps);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    const int64_t wd = (int64_t)heads * d;
    kvc_buf *X, *W;
    kvc_status st = scope_buf(&sc, sc.be->act_dtype, n * wd, x, n, wd, KVC_F32, &X);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, d, w, 1, d, KVC_F32, &W);
    if (st == KVC_OK) st = sc.be->head_rmsnorm(kvc_view_of(X, 0, wd), 0, n, heads, d, kvc_view_of(W, 0, d), eps);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(X, 0, wd), n, wd, x, KVC_F32);
    scope_end(&sc);
    return st;
}

/* The attention kernel over a store built from k, v; with pr_rows, rows [0, pr_rows[h]) of head h are then
 * pruned to the dk key channels kidx[h dk ..] (kv_prune_keys keeps only those rows) and the later rows
 * written again, in full. */
static kvc_status kernel_attention(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                   const float *const *k, const float *const *v, const int64_t *past_len,
                                   const int64_t *start, const int64_t *pr_rows, int32_t dk, const int32_t *kidx,
                                   float scale, float softcap, float *out, int32_t force_prefill) {
    CHECK(q && k && v && past_len && out, "attention: q, k, v, past_len and out must not be NULL");
    CHECK(n > 0 && H > 0 && Hkv > 0 && d > 0, "attention: sizes must be positive (n=%lld H=%d Hkv=%d d=%d)", (long long)n,
          H, Hkv, d);
    CHECK(H % Hkv == 0, "attention: the query heads H=%d must be a multiple of the KV heads Hkv=%d", H, Hkv);
    CHECK(Hkv <= KVC_MAX_KV_HEADS, "attention: at most %d KV heads, got %d", KVC_MAX_KV_HEADS, Hkv);
    CHECK(d <= 256, "attention: head_dim %d > 256 is not supported", d);
    CHECK(isfinite(scale), "attention: scale must be finite");
    CHECK(isfinite(softcap) && softcap >= 0, "attention: softcap must be finite and >= 0 (0: none), got %g", softcap);
    int64_t len[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv; h++) {
        CHECK(k[h] && v[h], "attention: k[%d] or v[%d] is NULL", h, h);
        CHECK(past_len[h] >= 0 && past_len[h] + n < 2147483647, "attention: past_len[%d] = %lld is out of range", h,
              (long long)past_len[h]);
        len[h] = past_len[h] + n;
        for (int64_t i = 0; start && i < n; i++) /* every query sees at least itself; starts never move back */
            CHECK(start[i * Hkv + h] >= 0 && start[i * Hkv + h] <= past_len[h] + i &&
                      (i == 0 || start[i * Hkv + h] >= start[(i - 1) * Hkv + h]),
                  "attention: window start[%lld, %d] = %lld is out of order or past the query's own row", (long long)i, h,
                  (long long)start[i * Hkv + h]);
    }
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_config mc;
    memset(&mc, 0, sizeof mc);
    mc.n_heads = H;
    mc.n_kv_heads = Hkv;
    mc.head_dim = d;
    kvc_status st = sc.be->check_model ? sc.be->check_model(&mc) : KVC_OK;
    const int64_t qd = (int64_t)H * d;
    kvc_buf *Q, *O, *S = NULL;
    int64_t zero[KVC_MAX_KV_HEADS] = {0}, cap[KVC_MAX_KV_HEADS], most = 1;
    for (int32_t h = 0; h < Hkv; h++) most = len[h] > most ? len[h] : most;
    for (int32_t h = 0; h < Hkv; h++) cap[h] = most; /* one capacity, as a full cache: heads at one stride (cuDNN's layout) */
    if (st == KVC_OK && start) st = scope_buf(&sc, KVC_I64, n * Hkv, start, n, Hkv, KVC_I64, &S);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->act_dtype, n * qd, q, n, qd, KVC_F32, &Q);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->act_dtype, n * qd, NULL, 0, 0, 0, &O);
    if (st == KVC_OK) st = sc.be->kv_new(Hkv, d, NULL, &sc.kv);
    if (st == KVC_OK) st = sc.be->kv_resize(sc.kv, cap, zero, NULL);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) st = sc.be->kv_write(sc.kv, h, 0, len[h], k[h], v[h]);
    if (st == KVC_OK && pr_rows) {
        st = sc.be->kv_set_lens(sc.kv, pr_rows);
        if (st == KVC_OK) st = sc.be->kv_prune_keys(sc.kv, dk, kidx);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            st = sc.be->kv_write(sc.kv, h, pr_rows[h], len[h] - pr_rows[h], k[h] + pr_rows[h] * d, v[h] + pr_rows[h] * d);
    }
    if (st == KVC_OK) st = sc.be->kv_set_lens(sc.kv, len);
    if (st == KVC_OK)
        st = sc.be->attention(kvc_view_of(Q, 0, qd), n, H, sc.kv, scale, softcap, kvc_view_of(S, 0, Hkv), kvc_view_of(O, 0, qd),
                              force_prefill ? KVC_ATTN_FORCE_PREFILL : 0);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(O, 0, qd), n, qd, out, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_attention(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                       const float *const *k, const float *const *v, const int64_t *past_len,
                                       const int64_t *start, float scale, float *out, int32_t force_prefill) {
    return kernel_attention(device, q, n, H, Hkv, d, k, v, past_len, start, NULL, 0, NULL, scale, 0.0f, out, force_prefill);
}

kvc_status kvc_device_kernel_attention_softcap(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                               const float *const *k, const float *const *v, const int64_t *past_len,
                                               const int64_t *start, float scale, float softcap, float *out,
                                               int32_t force_prefill) {
    return kernel_attention(device, q, n, H, Hkv, d, k, v, past_len, start, NULL, 0, NULL, scale, softcap, out,
                            force_prefill);
}

kvc_status kvc_device_kernel_attention_pruned(int32_t device, const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                                              const float *const *k, const float *const *v, const int64_t *past_len,
                                              const int64_t *pruned_rows, int32_t dk, const int32_t *kidx, float scale,
                                              float *out, int32_t force_prefill) {
    CHECK(pruned_rows && kidx, "attention_pruned: pruned_rows and kidx must not be NULL");
    CHECK(dk >= 1 && dk <= d, "attention_pruned: dk = %d kept channels of %d", dk, d);
    CHECK(Hkv > 0 && Hkv <= KVC_MAX_KV_HEADS, "attention_pruned: Hkv = %d", Hkv);
    for (int32_t h = 0; h < Hkv; h++) {
        CHECK(past_len && pruned_rows[h] >= 0 && pruned_rows[h] <= past_len[h] + n,
              "attention_pruned: head %d prunes %lld rows", h, (long long)pruned_rows[h]);
        for (int32_t j = 0; j < dk; j++)
            CHECK(kidx[h * dk + j] >= 0 && kidx[h * dk + j] < d && (j == 0 || kidx[h * dk + j] > kidx[h * dk + j - 1]),
                  "attention_pruned: head %d channels must increase inside [0, %d)", h, d);
    }
    return kernel_attention(device, q, n, H, Hkv, d, k, v, past_len, NULL, pruned_rows, dk, kidx, scale, 0.0f, out,
                            force_prefill);
}

/* the store of kvc_device_kernel_kv_rows: rows [0, len) written and held, pruned to dk channels */
static kvc_status kv_rows_store(const kvc_backend *be, kvc_kv *kv, int32_t Hkv, int32_t d, int64_t len, int32_t dk,
                                float *rowbuf) {
    int64_t cap[KVC_MAX_KV_HEADS], held[KVC_MAX_KV_HEADS];
    int32_t kidx[KVC_MAX_KV_HEADS * 256];
    for (int32_t h = 0; h < Hkv; h++) {
        cap[h] = len + 4;
        held[h] = 0;
    }
    KVC_TRY(be->kv_resize(kv, cap, held, NULL));
    for (int64_t i = 0; i < len * d; i++) rowbuf[i] = (float)(i % 97) * 0.125f;
    for (int32_t h = 0; h < Hkv; h++) {
        KVC_TRY(be->kv_write(kv, h, 0, len, rowbuf, rowbuf));
        held[h] = len;
    }
    KVC_TRY(be->kv_set_lens(kv, held));
    for (int32_t i = 0; i < Hkv * dk; i++) kidx[i] = i % dk;
    return dk > 0 ? be->kv_prune_keys(kv, dk, kidx) : KVC_OK;
}

kvc_status kvc_device_kernel_kv_rows(int32_t device, int32_t op, int32_t Hkv, int32_t d, int64_t len, int32_t dk,
                                     int64_t row0, int64_t rows) {
    CHECK(op >= 0 && op <= 4, "kv_rows: op %d is not 0 (read), 1 (gather), 2 (write), 3 (batched read) or 4 (batched write)",
          op);
    CHECK(Hkv > 0 && Hkv <= KVC_MAX_KV_HEADS && d > 0 && d <= 256 && dk >= 0 && dk <= d, "kv_rows: Hkv %d, d %d, dk %d", Hkv,
          d, dk);
    CHECK(len >= 0 && len <= 4096 && row0 >= -4096 && row0 <= 8192 && rows >= 0 && rows <= 4096, "kv_rows: rows out of range");
    const int64_t n = (len + 4 > rows ? len + 4 : rows) * d;
    const size_t all = (size_t)Hkv * (size_t)(rows > 0 ? rows : 1) * (size_t)d; /* every head's rows, K then V */
    float *buf = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    int64_t *keep = malloc(sizeof(int64_t) * (size_t)(rows > 0 ? rows : 1));
    float *a = malloc(sizeof(float) * all * 2), *b = malloc(sizeof(float) * all * 2);
    if (!buf || !keep || !a || !b) {
        free(buf); free(keep); free(a); free(b);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: kv_rows");
    }
    const int64_t *keeps[KVC_MAX_KV_HEADS];
    int64_t nk[KVC_MAX_KV_HEADS], r0[KVC_MAX_KV_HEADS];
    for (int64_t i = 0; i < rows; i++) keep[i] = row0 + i;
    for (int32_t h = 0; h < Hkv; h++) {
        keeps[h] = keep;
        nk[h] = rows;
        r0[h] = row0;
    }
    const size_t hv = (size_t)rows * d; /* values of one head's rows */
    scope sc;
    kvc_status st = scope_begin(&sc, device);
    if (st == KVC_OK) {
        st = sc.be->kv_new(Hkv, d, NULL, &sc.kv);
        if (st == KVC_OK) st = kv_rows_store(sc.be, sc.kv, Hkv, d, len, dk, buf);
        for (int32_t h = 0; h < Hkv && st == KVC_OK && op <= 2 && op != 1; h++)
            st = op == 0 ? sc.be->kv_read(sc.kv, h, row0, rows, buf, buf) : sc.be->kv_write(sc.kv, h, row0, rows, buf, buf);
        if (st == KVC_OK && op == 1) st = sc.be->kv_gather(sc.kv, keeps, nk, nk);
        if (st == KVC_OK && op == 3) { /* the batched read against a read per head */
            st = sc.be->kv_read_heads(sc.kv, r0, nk, a, a + all);
            for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
                st = sc.be->kv_read(sc.kv, h, row0, rows, b + h * hv, b + all + h * hv);
                if (st == KVC_OK && (memcmp(a + h * hv, b + h * hv, sizeof(float) * hv) ||
                                     memcmp(a + all + h * hv, b + all + h * hv, sizeof(float) * hv)))
                    st = kvc_fail(KVC_ERR_INTERNAL, "kv_rows: the batched read of head %d differs from its own read", h);
            }
        }
        if (st == KVC_OK && op == 4) { /* the batched write, read back (values a store keeps exactly: eighths) */
            for (size_t i = 0; i < all * 2; i++) a[i] = (float)((i * 7) % 61) * 0.125f;
            st = sc.be->kv_write_rows(sc.kv, keeps, nk, a, a + all);
            int64_t held[KVC_MAX_KV_HEADS];
            for (int32_t h = 0; h < Hkv; h++) held[h] = row0 + rows > len ? row0 + rows : len;
            if (st == KVC_OK && rows > 0) st = sc.be->kv_set_lens(sc.kv, held); /* rows written past the held ones */
            for (int32_t h = 0; h < Hkv && st == KVC_OK && rows > 0; h++) {
                st = sc.be->kv_read(sc.kv, h, row0, rows, b + h * hv, b + all + h * hv);
                /* pruned keys keep their dk channels only: their values are compared, the keys where nothing is pruned */
                if (st == KVC_OK && ((dk == 0 && memcmp(a + h * hv, b + h * hv, sizeof(float) * hv)) ||
                                     memcmp(a + all + h * hv, b + all + h * hv, sizeof(float) * hv)))
                    st = kvc_fail(KVC_ERR_INTERNAL, "kv_rows: head %d's rows read back differ from the batched write", h);
            }
        }
        scope_end(&sc);
    }
    free(buf);
    free(keep);
    free(a);
    free(b);
    return st;
}

kvc_status kvc_device_kernel_kv_store(int32_t device, const kvc_kv_format *fmt, int32_t Hkv, int32_t d, int64_t n,
                                      int64_t step, const float *k, const float *v, float *k_out, float *v_out,
                                      size_t *bytes) {
    CHECK(k && v && k_out && v_out && bytes, "kv_store: k, v, k_out, v_out and bytes must not be NULL");
    CHECK(Hkv > 0 && Hkv <= KVC_MAX_KV_HEADS && d > 0 && n >= 0 && n <= (1 << 24) && step > 0,
          "kv_store: Hkv %d, d %d, n %lld, step %lld", Hkv, d, (long long)n, (long long)step);
    int64_t cap[KVC_MAX_KV_HEADS], held[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv; h++) {
        cap[h] = n;
        held[h] = 0;
    }
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_status st = sc.be->kv_new(Hkv, d, fmt, &sc.kv);
    if (st == KVC_OK) st = sc.be->kv_resize(sc.kv, cap, held, NULL);
    for (int64_t r0 = 0; r0 < n && st == KVC_OK; r0 += step) {
        const int64_t m = n - r0 < step ? n - r0 : step;
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const size_t at = ((size_t)h * (size_t)n + (size_t)r0) * (size_t)d;
            st = sc.be->kv_write(sc.kv, h, r0, m, k + at, v + at);
            held[h] = r0 + m;
        }
        if (st == KVC_OK) st = sc.be->kv_set_lens(sc.kv, held);
        if (st == KVC_OK) st = sc.be->kv_commit(sc.kv);
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK && n > 0; h++) {
        const size_t at = (size_t)h * (size_t)n * (size_t)d;
        st = sc.be->kv_read(sc.kv, h, 0, n, k_out + at, v_out + at);
    }
    if (st == KVC_OK) *bytes = sc.be->kv_bytes(sc.kv);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_topk(int32_t device, const float *scores, int32_t heads, int64_t n, const int64_t *k,
                                  int64_t *keep) {
    CHECK(scores && k && keep, "topk: null argument");
    CHECK(heads > 0 && n > 0 && n < 2147483647, "topk: bad sizes (heads=%d n=%lld)", heads, (long long)n);
    int64_t *len = malloc(sizeof(int64_t) * (size_t)heads), *kk = malloc(sizeof(int64_t) * (size_t)heads);
    int64_t **rows = malloc(sizeof(int64_t *) * (size_t)heads);
    if (!len || !kk || !rows) {
        free(len); free(kk); free(rows);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: top-k");
    }
    for (int32_t h = 0; h < heads; h++) {
        len[h] = n;
        kk[h] = k[h] < 0 ? 0 : k[h] > n ? n : k[h];
        rows[h] = keep + (size_t)h * n;
    }
    scope sc;
    kvc_status st = scope_begin(&sc, device);
    if (st == KVC_OK) {
        kvc_buf *S;
        st = scope_buf(&sc, KVC_F32, (int64_t)heads * n, scores, heads, n, KVC_F32, &S);
        if (st == KVC_OK) st = sc.be->topk(kvc_view_of(S, 0, n), heads, len, kk, rows);
        scope_end(&sc);
    }
    free(len);
    free(kk);
    free(rows);
    return st;
}

/* ---- mixture of experts ---- */

kvc_status kvc_device_kernel_moe_route(int32_t device, const float *logits, int64_t n, int32_t E, int32_t k, int32_t norm,
                                       int32_t *ids, float *w) {
    CHECK(logits && ids && w, "moe_route: null argument");
    CHECK(n > 0 && E > 0 && E <= 4096 && k > 0 && k <= E, "moe_route: bad sizes (n=%lld E=%d k=%d)", (long long)n, E, k);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *L, *I, *W;
    kvc_status st = scope_buf(&sc, KVC_F32, n * E, logits, n, E, KVC_F32, &L);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_I32, n * k, NULL, 0, 0, 0, &I);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, n * k, NULL, 0, 0, 0, &W);
    if (st == KVC_OK) st = sc.be->moe_route(kvc_view_of(L, 0, E), n, E, k, norm != 0, kvc_view_of(I, 0, k), kvc_view_of(W, 0, k));
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(I, 0, k), n, k, ids, KVC_I32);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(W, 0, k), n, k, w, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_gather_rows(int32_t device, const float *src, int64_t src_rows, const int32_t *idx, int64_t n,
                                         int64_t D, float *dst) {
    CHECK(src && idx && dst, "gather_rows: null argument");
    CHECK(src_rows > 0 && n > 0 && D > 0, "gather_rows: sizes must be positive");
    for (int64_t i = 0; i < n; i++) CHECK(idx[i] >= 0 && idx[i] < src_rows, "gather_rows: index %d outside [0, %lld)", idx[i], (long long)src_rows);
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *S, *I, *O;
    kvc_status st = scope_buf(&sc, sc.be->act_dtype, src_rows * D, src, src_rows, D, KVC_F32, &S);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_I32, n, idx, 1, n, KVC_I32, &I);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->act_dtype, n * D, NULL, 0, 0, 0, &O);
    if (st == KVC_OK) st = sc.be->gather_rows(kvc_view_of(S, 0, D), kvc_view_of(I, 0, n), n, D, kvc_view_of(O, 0, D));
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(O, 0, D), n, D, dst, KVC_F32);
    scope_end(&sc);
    return st;
}

kvc_status kvc_device_kernel_moe_combine(int32_t device, float *x, const float *y, const float *w, const int32_t *pos, int64_t n,
                                         int32_t k, int64_t D) {
    CHECK(x && y && w && pos, "moe_combine: null argument");
    CHECK(n > 0 && k > 0 && D > 0, "moe_combine: sizes must be positive");
    for (int64_t i = 0; i < n * k; i++) CHECK(pos[i] >= 0 && pos[i] < n * k, "moe_combine: row %d outside [0, %lld)", pos[i], (long long)(n * k));
    scope sc;
    KVC_TRY(scope_begin(&sc, device));
    kvc_buf *X, *Y, *W, *P;
    kvc_status st = scope_buf(&sc, KVC_F32, n * D, x, n, D, KVC_F32, &X);
    if (st == KVC_OK) st = scope_buf(&sc, sc.be->act_dtype, n * k * D, y, n * k, D, KVC_F32, &Y);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_F32, n * k, w, n, k, KVC_F32, &W);
    if (st == KVC_OK) st = scope_buf(&sc, KVC_I32, n * k, pos, n, k, KVC_I32, &P);
    if (st == KVC_OK)
        st = sc.be->moe_combine(kvc_view_of(X, 0, D), kvc_view_of(Y, 0, D), kvc_view_of(W, 0, k), kvc_view_of(P, 0, k), n, k, D);
    if (st == KVC_OK) st = sc.be->download(kvc_view_of(X, 0, D), n, D, x, KVC_F32);
    scope_end(&sc);
    return st;
}
