/* A scorer the caller gives (kvc_scorer_callback, kvpress_c.h): a C function, or a Python press through the
 * module's own callback (python/presses/pyscorer.c). Three rows, one per way its result is used:
 *   "callback"         its scores, ranked by the press's allocation (uniform, PyramidKV, Ada-KV, ChunkKV, ...);
 *   "callback_window"  the same with the last `window` rows of every head protected (WINDOW, as SnapKV's);
 *   "callback_stats"   the same, reading every query of the call (all_queries): QUERY_STATS, so a decoding press
 *                      buffers every row's query for it, as for ExpectedAttention;
 *   "callback_select"  its own kept rows (OWN_BUDGET): the host function marks them 1, the others 0, and the
 *                      row's selection keeps the marked rows.
 * The view (kvc_scorer_view) is built here: every head's rows padded to the longest head (host f32 copies), or with
 * KVC_VIEW_IN_PLACE the store's own rows (kv_rows: no copy of f32 host rows), the window's queries, the normed input
 * and the window's attention when the config's callback_needs asks. A callback whose arrays must outlive its call
 * retains the view (kvc_scorer_view_retain: the store continues in a copy, the handle keeps the old rows). What a
 * callback returns is checked here, once, for every binding: finite scores, kept rows in range and unique. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* The window queries' softmax over each head's rows: [H, w, maxlen], query i sees rows < len - w + i + 1; head h's
 * row r at k[h] + r d. */
static void window_attention(const kvc_config *c, const int64_t *len, int64_t maxlen, int32_t w, const float *q,
                             const float *const *k, float *out) {
    const int32_t H = c->n_heads, g = c->n_heads / c->n_kv_heads, d = c->head_dim;
    const double scale = 1.0 / sqrt((double)d);
#pragma omp parallel for schedule(static)
    for (int32_t hq = 0; hq < H; hq++) {
        const int32_t h = hq / g;
        for (int32_t i = 0; i < w; i++) {
            const float *qi = q + ((size_t)i * H + hq) * d;
            float *row = out + ((size_t)hq * w + i) * maxlen;
            int64_t vis = len[h] - w + i + 1;
            vis = vis < 1 ? (len[h] < 1 ? len[h] : 1) : vis > len[h] ? len[h] : vis;
            double mx = -INFINITY, sum = 0;
            for (int64_t r = 0; r < vis; r++) {
                const float *kr = k[h] + (size_t)r * d;
                double dot = 0;
                for (int32_t j = 0; j < d; j++) dot += (double)qi[j] * kr[j];
                row[r] = (float)(dot * scale);
                mx = row[r] > mx ? row[r] : mx;
            }
            for (int64_t r = 0; r < vis; r++) sum += exp((double)row[r] - mx);
            for (int64_t r = 0; r < vis; r++) row[r] = (float)(exp((double)row[r] - mx) / sum);
            for (int64_t r = vis; r < maxlen; r++) row[r] = 0;
        }
    }
}

/* kvc_scorer_view.rows_dtype gives the store's own dtype codes */
typedef char kvc_rows_dtype_codes_match[(int)KVC_ROWS_F32 == (int)KVC_F32 && (int)KVC_ROWS_BF16 == (int)KVC_BF16 ? 1 : -1];

/* A running callback's view as the engine keeps it, for kvc_scorer_view_retain. */
typedef struct view_ctx {
    const kvc_backend *be;
    kvc_kv *kv;
    int lent;       /* key_rows and value_rows are the store's */
    float *copies;  /* the view's host copies: keys, values, queries, hidden, attentions */
    int64_t *pos;
    int retained;   /* copies and pos belong to a handle now */
} view_ctx;

/* What a retained view keeps: the store's old rows (kv_keep_rows) and the copies. */
typedef struct view_handle {
    const kvc_backend *be;
    void *kept;
    float *copies;
    int64_t *pos;
} view_handle;

void *kvc_scorer_view_retain(const kvc_scorer_view *view) {
    view_ctx *c = view ? (view_ctx *)view->engine : NULL;
    if (!c) {
        kvc_fail(KVC_ERR_ARG, "kvc_scorer_view_retain: not the view of a running callback");
        return NULL;
    }
    if (c->retained) {
        kvc_fail(KVC_ERR_ARG, "kvc_scorer_view_retain: layer %d's view is retained already", view->layer);
        return NULL;
    }
    view_handle *hd = calloc(1, sizeof *hd);
    if (!hd) {
        kvc_fail(KVC_ERR_NOMEM, "out of memory: a retained view");
        return NULL;
    }
    if (c->lent && c->be->kv_keep_rows(c->kv, &hd->kept) != KVC_OK) {
        free(hd);
        return NULL;
    }
    hd->be = c->be;
    hd->copies = c->copies;
    hd->pos = c->pos;
    c->retained = 1;
    return hd;
}

void kvc_scorer_view_release(void *handle) {
    view_handle *hd = handle;
    if (!hd) return;
    if (hd->kept) hd->be->kv_kept_free(hd->kept);
    free(hd->copies);
    free(hd->pos);
    free(hd);
}

/* The callback's kept rows of a head: in [0, len), unique; sorted in place. */
static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static kvc_status check_keep(int32_t layer, int32_t h, int64_t len, int64_t *keep, int64_t n) {
    if (n < 0 || n > len)
        return kvc_fail(KVC_ERR_ARG, "layer %d, head %d: the callback scorer kept %lld rows of %lld", layer, h, (long long)n,
                        (long long)len);
    for (int64_t i = 0; i < n; i++)
        if (keep[i] < 0 || keep[i] >= len)
            return kvc_fail(KVC_ERR_ARG, "layer %d, head %d: the callback scorer's kept row %lld is outside [0, %lld)", layer, h, (long long)keep[i],
                            (long long)len);
    qsort(keep, (size_t)n, sizeof *keep, cmp_i64);
    for (int64_t i = 1; i < n; i++)
        if (keep[i] == keep[i - 1])
            return kvc_fail(KVC_ERR_ARG, "layer %d, head %d: the callback scorer's kept row %lld is given twice", layer, h, (long long)keep[i]);
    return KVC_OK;
}

static kvc_status callback_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const kvc_backend *be = lr->be;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim, D = c->hidden;
    const int32_t needs = cfg->callback_needs;
    const int select = kvc_scorer_of(cfg->scorer)->select != NULL;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    int32_t w = needs & KVC_VIEW_ALL_QUERIES ? (int32_t)ctx->n : cfg->window < 0 ? 0 : cfg->window;
    if (w > ctx->n) w = (int32_t)ctx->n;
    const int32_t needs_q = KVC_VIEW_QUERIES | KVC_VIEW_ALL_QUERIES;
    if ((needs & (needs_q | KVC_VIEW_ATTENTIONS)) && w < 1)
        return kvc_fail(KVC_ERR_ARG, "the callback scorer reads window queries: window must be >= 1");
    if ((needs & KVC_VIEW_HIDDEN) && !ctx->xn.buf)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "layer %d: this call gives no hidden states to the callback scorer", ctx->layer);

    /* the rows lent in place when asked and every head keeps them plainly in one type; f32 in host memory is read
     * as it is (no copy of the keys and values) */
    const void *kr[KVC_MAX_KV_HEADS] = {0}, *vr[KVC_MAX_KV_HEADS] = {0};
    int32_t lent = -1;
    if ((needs & KVC_VIEW_IN_PLACE) && be->kv_rows) {
        lent = be->kv_rows(lr->kv, 0, &kr[0], &vr[0]);
        for (int32_t h = 1; h < Hkv && lent >= 0; h++)
            if (be->kv_rows(lr->kv, h, &kr[h], &vr[h]) != lent) lent = -1;
    }
    const int in_place = lent == KVC_F32 && be->host_memory;

    const size_t rows = (size_t)Hkv * (size_t)maxlen;
    const size_t nk = in_place ? 0 : rows * (size_t)d, nv = needs & KVC_VIEW_VALUES ? nk : 0;
    const size_t nq = needs & (needs_q | KVC_VIEW_ATTENTIONS) ? (size_t)w * H * d : 0;
    const size_t nh = needs & KVC_VIEW_HIDDEN ? (size_t)ctx->n * D : 0;
    const size_t na = needs & KVC_VIEW_ATTENTIONS ? (size_t)H * w * (size_t)maxlen : 0;
    float *f = calloc(nk + nv + nq + nh + na + 1, sizeof(float));
    float *sc = select ? NULL : calloc(rows, sizeof(float));
    int64_t *keep = select ? calloc(rows + (size_t)Hkv, sizeof(int64_t)) : NULL;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(ctx->n > 0 ? ctx->n : 1));
    if (!f || !pos || (select ? !keep : !sc)) {
        free(f), free(sc), free(keep), free(pos);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: the callback scorer's view of layer %d", ctx->layer);
    }
    float *k = f, *v = k + nk, *q = v + nv, *hid = q + nq, *att = hid + nh;
    const float *kh[KVC_MAX_KV_HEADS]; /* each head's keys as the window attention reads them */
    for (int32_t h = 0; h < Hkv; h++) kh[h] = in_place ? (const float *)kr[h] : k + (size_t)h * maxlen * d;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK && nk; h++)
        if (len[h] > 0) st = be->kv_read(lr->kv, h, 0, len[h], k + (size_t)h * maxlen * d, nv ? v + (size_t)h * maxlen * d : NULL);
    if (st == KVC_OK && nq) st = be->download(kvc_view_at(ctx->q, ctx->n - w, 0), w, (int64_t)H * d, q, KVC_F32);
    if (st == KVC_OK && nh) st = be->download(kvc_view_at(ctx->xn, 0, 0), ctx->n, D, hid, KVC_F32);
    if (st == KVC_OK && na) window_attention(c, len, maxlen, w, q, kh, att);
    if (st == KVC_OK && lent >= 0 && !be->host_memory && be->sync) st = be->sync(); /* device rows complete */
    for (int64_t i = 0; i < ctx->n; i++) pos[i] = ctx->pos ? ctx->pos[i] : ctx->past_len[0] + i;

    double freq[128], ms = 1;
    if (st == KVC_OK) st = kvc_layer_freqs(lr, ctx->layer, ctx->n > 0 ? kvc_call_end(ctx) : ctx->past_len[0], freq, &ms);
    char message[512] = "";
    view_ctx engine = {.be = be, .kv = lr->kv, .lent = lent >= 0, .copies = f, .pos = pos};
    const kvc_scorer_view view = {
        .layer = ctx->layer, .n_layers = c->n_layers, .n_heads = H, .n_kv_heads = Hkv, .head_dim = d, .hidden_dim = D,
        .device = be->device, .len = len, .max_len = maxlen, .keys = nk ? k : NULL, .values = nv ? v : NULL,
        .n_call = ctx->n, .positions = pos, .window = w, .queries = needs & needs_q ? q : NULL, .hidden = nh ? hid : NULL,
        .attentions = na ? att : NULL, .scores = sc, .keep = keep, .n_keep = keep ? keep + rows : NULL,
        .message = message, .message_size = (int32_t)sizeof message, .rope_pairing = c->rope_pairing, .rope_freq = freq, .rope_attn_factor = ms,
        .future_from = lr->future_from > 0 ? lr->future_from : (ctx->n > 0 ? pos[ctx->n - 1] + 1 : 0),
        .key_rows = lent >= 0 ? kr : NULL, .value_rows = lent >= 0 && (needs & KVC_VIEW_VALUES) ? vr : NULL,
        .rows_dtype = lent >= 0 ? lent : 0, .rows_host = be->host_memory, .engine = &engine};
    const kvc_scorer_callback fn = (kvc_scorer_callback)(uintptr_t)cfg->callback;
    if (st == KVC_OK && fn((void *)(uintptr_t)cfg->callback_user, &view) != 0) {
        message[sizeof message - 1] = 0;
        st = kvc_fail(KVC_ERR_ARG, "layer %d: the callback scorer failed%s%s", ctx->layer, *message ? ": " : "", message);
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (select) { /* the kept rows marked 1: the row's selection keeps them */
            int64_t *kp = keep + (size_t)h * maxlen;
            st = check_keep(ctx->layer, h, len[h], kp, keep[rows + h]);
            for (int64_t r = 0; r < len[h]; r++) scores[h][r] = 0;
            for (int64_t i = 0; i < keep[rows + h] && st == KVC_OK; i++) scores[h][kp[i]] = 1;
            continue;
        }
        const float *sh = sc + (size_t)h * maxlen;
        for (int64_t r = 0; r < len[h] && st == KVC_OK; r++)
            if (!isfinite(sh[r]))
                st = kvc_fail(KVC_ERR_ARG, "layer %d, head %d: the callback scorer's score of row %lld is %s (scores must be finite)",
                              ctx->layer, h, (long long)r, isnan(sh[r]) ? "NaN" : "infinite");
        if (st == KVC_OK) memcpy(scores[h], sh, sizeof(float) * (size_t)len[h]);
    }
    if (st == KVC_OK && (kvc_scorer_of(cfg->scorer)->traits & KVC_SCORER_WINDOW)) {
        /* the window protected as kvpress's window presses do: the layer's highest score + 1 */
        float top = -INFINITY;
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < len[h] - w; r++) top = scores[h][r] > top ? scores[h][r] : top;
        top = isfinite(top) ? top + 1 : 1;
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = len[h] - w > 0 ? len[h] - w : 0; r < len[h]; r++) scores[h][r] = top;
    }
    if (!engine.retained) free(f), free(pos); /* else kvc_scorer_view_release frees them */
    free(sc), free(keep);
    return st;
}

/* callback_select's selection: the rows its host function marked. */
static kvc_status marked_select(const kvc_config *mc, const kvc_press_config *cfg, const int64_t *len,
                                const float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    (void)cfg;
    for (int32_t h = 0; h < mc->n_kv_heads; h++) {
        n_keep[h] = 0;
        for (int64_t r = 0; r < len[h]; r++)
            if (scores[h][r] > 0.5f) keep[h][n_keep[h]++] = r;
    }
    return KVC_OK;
}

static kvc_status check(const kvc_press_config *c) {
    if (!c->callback) return kvc_fail(KVC_ERR_ARG, "a callback scorer needs its function: set \"callback\"");
    return KVC_OK;
}

static const char *const params[] = {"callback", "callback_user", "callback_needs", "window", NULL};

static const kvc_scorer_i callback_scorer = {
    .name = "callback",
    .title = "Callback",
    .code = -1,
    .traits = KVC_SCORER_HOST | KVC_SCORER_CHUNKABLE | KVC_SCORER_BLOCKABLE, /* BlockPress: keys (and values) only */
    .params = params,
    .check = check,
    .host = callback_scores,
    .select = NULL,
    .doc = "scores from a function the caller gives (kvc_scorer_callback; Python presses defining score())",
};
KVC_REGISTER_SCORER(callback_scorer);

static const kvc_scorer_i callback_window_scorer = {
    .name = "callback_window",
    .title = "CallbackWindow",
    .code = -1,
    .traits = KVC_SCORER_HOST | KVC_SCORER_WINDOW | KVC_SCORER_CHUNKABLE,
    .params = params,
    .check = check,
    .host = callback_scores,
    .select = NULL,
    .doc = "scores from a function the caller gives, the last window rows protected",
};
KVC_REGISTER_SCORER(callback_window_scorer);

static const kvc_scorer_i callback_stats_scorer = {
    .name = "callback_stats",
    .title = "CallbackStats",
    .code = -1,
    .traits = KVC_SCORER_HOST | KVC_SCORER_QUERY_STATS, /* a decoding press buffers every row's query for it */
    .params = params,
    .check = check,
    .host = callback_scores,
    .select = NULL,
    .doc = "scores from a function the caller gives, from every query of the call (ExpectedAttention-like statistics)",
};
KVC_REGISTER_SCORER(callback_stats_scorer);

static const kvc_scorer_i callback_select_scorer = {
    .name = "callback_select",
    .title = "CallbackSelect",
    .code = -1,
    .traits = KVC_SCORER_HOST | KVC_SCORER_OWN_BUDGET,
    .params = params,
    .check = check,
    .host = callback_scores,
    .select = marked_select,
    .doc = "kept rows chosen by a function the caller gives (Python presses defining compress())",
};
KVC_REGISTER_SCORER(callback_select_scorer);
