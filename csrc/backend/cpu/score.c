/* The scorers of the CPU backend, on host fp32 arrays: the reference every other backend's `score`
 * entry is tested against (docs/METHODS.md, "Baseline scorers", "EDIE scoring", "TAKE"). Each fills
 * scores[h][r] for the rows r < len[h] of every KV head; higher means keep; protected rows (the window)
 * get max + 1 so they sort first without +inf arithmetic.
 *
 * The scoring queries are m rows of q (stride ldq): SnapKV's and EDIE's window (the last w rows of the
 * cache are theirs, causal inside the window), TOVA's last query, or TAKE's probes (they see every row
 * given, nothing causal). */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "../../core/rng.h"
#include "cpu.h"
#include "host.h"

typedef struct layer_in {
    int32_t H, Hkv, d;
    const float *const *k, *const *v; /* [Hkv] -> [len[h], d] */
    const int64_t *len;
    const float *q; /* the m scoring queries, row stride ldq, head hq at column hq d */
    int64_t ldq, m;
    int causal;     /* query j sees rows < len - m + j + 1, else all len */
    const float *attn; /* EDIE: the scoring queries' attention outputs (stride ld_attn) */
    int64_t ld_attn;
} layer_in;

static void gather(const layer_in *in, int32_t hq, float *dst) {
    for (int64_t j = 0; j < in->m; j++) memcpy(dst + j * in->d, in->q + j * in->ldq + (int64_t)hq * in->d, sizeof(float) * in->d);
}

static void visibility(const layer_in *in, int32_t h, int64_t *vis) {
    for (int64_t j = 0; j < in->m; j++) vis[j] = in->causal ? in->len[h] - in->m + j + 1 : in->len[h];
}

static int64_t max_len(const layer_in *in) {
    int64_t m = 1;
    for (int32_t h = 0; h < in->Hkv; h++) m = in->len[h] > m ? in->len[h] : m;
    return m;
}

/* out[hq][r], r < n_acc(h): mean over the m queries of query head hq's softmax attention on row r. */
static kvc_status window_attention(const layer_in *in, const int64_t *n_acc, float *const *out) {
    const int32_t g = in->H / in->Hkv, d = in->d;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t ml = max_len(in), m = in->m;
    float *qw = malloc(sizeof(float) * (size_t)m * d);
    float *probs = malloc(sizeof(float) * (size_t)m * (size_t)ml);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)m);
    kvc_status st = (!qw || !probs || !vis) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: window attention scores") : KVC_OK;
    for (int32_t hq = 0; hq < in->H && st == KVC_OK; hq++) {
        const int32_t h = hq / g;
        const int64_t len = in->len[h], na = n_acc[h];
        gather(in, hq, qw);
        visibility(in, h, vis);
        kvc_host_probs_rows(qw, m, in->k[h], len, d, scale, vis, probs);
        float *acc = out[hq];
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < na; r++) {
            double s = 0;
            for (int64_t j = 0; j < m; j++) s += probs[(size_t)j * len + r];
            acc[r] = (float)(s / m);
        }
    }
    free(qw);
    free(probs);
    free(vis);
    return st;
}

/* 1-D pooling, stride 1, padding k/2: average counts the padding (torch avg_pool1d default); max
 * ignores it (torch max_pool1d pads with -inf). */
static void pool1d(const float *x, float *y, int64_t n, int32_t k, int pool_max) {
    const int32_t half = k / 2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t lo = i - half < 0 ? 0 : i - half, hi = i + half >= n ? n - 1 : i + half;
        if (pool_max) {
            float mx = -FLT_MAX;
            for (int64_t j = lo; j <= hi; j++) mx = x[j] > mx ? x[j] : mx;
            y[i] = mx;
        } else {
            double s = 0;
            for (int64_t j = lo; j <= hi; j++) s += x[j];
            y[i] = (float)(s / k);
        }
    }
}

/* Per-query-head rows att[hq][0 .. n_acc[h]) -> scores[h] by pooling and GQA reduction (either order). */
static void pool_reduce(const layer_in *in, float *const *att, const int64_t *n_acc, int32_t kernel, int pool_max,
                        int gqa_max, int pool_then_reduce, float *tmp, float *const *scores) {
    const int32_t g = in->H / in->Hkv;
    for (int32_t h = 0; h < in->Hkv; h++) {
        const int64_t na = n_acc[h];
        float *s = scores[h];
        if (pool_then_reduce) {
            for (int32_t j = 0; j < g; j++) {
                pool1d(att[h * g + j], tmp, na, kernel, pool_max);
                for (int64_t r = 0; r < na; r++) {
                    if (j == 0) s[r] = tmp[r];
                    else s[r] = gqa_max ? (tmp[r] > s[r] ? tmp[r] : s[r]) : s[r] + tmp[r];
                }
            }
            if (!gqa_max)
                for (int64_t r = 0; r < na; r++) s[r] /= (float)g;
        } else {
            for (int64_t r = 0; r < na; r++) {
                float v = att[h * g][r];
                for (int32_t j = 1; j < g; j++) {
                    const float x = att[h * g + j][r];
                    v = gqa_max ? (x > v ? x : v) : v + x;
                }
                tmp[r] = gqa_max ? v : v / (float)g;
            }
            pool1d(tmp, s, na, kernel, pool_max);
        }
    }
}

/* rows [n_acc[h], len[h]) of every head get (the largest scored value of the layer) + 1 */
static void protect_tail(const layer_in *in, const int64_t *n_acc, float *const *scores) {
    float mx = -FLT_MAX;
    for (int32_t h = 0; h < in->Hkv; h++)
        for (int64_t r = 0; r < n_acc[h]; r++) mx = scores[h][r] > mx ? scores[h][r] : mx;
    if (mx == -FLT_MAX) mx = 0.f;
    for (int32_t h = 0; h < in->Hkv; h++)
        for (int64_t r = n_acc[h]; r < in->len[h]; r++) scores[h][r] = mx + 1.f;
}

/* per-query-head scratch rows [H][maxlen] */
static float **rows_alloc(int32_t H, int64_t ml) {
    float **a = calloc((size_t)H, sizeof *a);
    if (!a) return NULL;
    for (int32_t hq = 0; hq < H; hq++)
        if (!(a[hq] = malloc(sizeof(float) * (size_t)ml))) {
            for (int32_t i = 0; i < hq; i++) free(a[i]);
            free(a);
            return NULL;
        }
    return a;
}

static void rows_free(float **a, int32_t H) {
    if (!a) return;
    for (int32_t hq = 0; hq < H; hq++) free(a[hq]);
    free(a);
}

/* SnapKV family and TAKE's probes: window attention -> pooling -> GQA reduction (-> window protected). */
static kvc_status score_window(const layer_in *in, const kvc_score_args *a, int protect, float *const *scores) {
    const int64_t ml = max_len(in);
    int64_t *n_acc = malloc(sizeof(int64_t) * (size_t)in->Hkv);
    float **att = rows_alloc(in->H, ml);
    float *tmp = malloc(sizeof(float) * (size_t)ml);
    kvc_status st = (!n_acc || !att || !tmp) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores") : KVC_OK;
    if (st == KVC_OK) {
        for (int32_t h = 0; h < in->Hkv; h++) n_acc[h] = in->len[h] - (protect ? in->m : 0);
        st = window_attention(in, n_acc, att);
    }
    if (st == KVC_OK) {
        pool_reduce(in, att, n_acc, a->kernel, a->pool_max, a->gqa_max, a->pool_then_reduce, tmp, scores);
        if (protect) protect_tail(in, n_acc, scores);
    }
    free(n_acc);
    free(tmp);
    rows_free(att, in->H);
    return st;
}

/* TOVA: the last query's attention (over every row but its own), mean over all heads of the layer;
 * the same scores for every KV head; the last row protected. */
static kvc_status score_tova(const layer_in *in, float *const *scores) {
    const int64_t len = in->len[0];
    for (int32_t h = 1; h < in->Hkv; h++)
        if (in->len[h] != len) return kvc_fail(KVC_ERR_ARG, "TOVA needs every head of a layer to hold the same tokens");
    int64_t *n_acc = malloc(sizeof(int64_t) * (size_t)in->Hkv);
    float **att = rows_alloc(in->H, len);
    kvc_status st = (!n_acc || !att) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores") : KVC_OK;
    if (st == KVC_OK) {
        for (int32_t h = 0; h < in->Hkv; h++) n_acc[h] = len - 1;
        st = window_attention(in, n_acc, att);
    }
    if (st == KVC_OK) {
        for (int64_t r = 0; r < len - 1; r++) {
            double sum = 0;
            for (int32_t hq = 0; hq < in->H; hq++) sum += att[hq][r];
            const float v = (float)(sum / in->H);
            for (int32_t h = 0; h < in->Hkv; h++) scores[h][r] = v;
        }
        protect_tail(in, n_acc, scores);
    }
    free(n_acc);
    rows_free(att, in->H);
    return st;
}

/* EDIE (EDIE-TADA-error-driven-eviction.txt; docs/METHODS.md "EDIE scoring"), window queries j, past rows i:
 *   U_i^j = a_i^j / (1 + alpha - a_i^j) * (|v_i|_1 + |o_j|_1)
 *   c_j   = max over the mid-range rows w < i <= len - 2w of a_i^j   (all past rows if empty)
 *   I_i   = sum_j c_j U_i^j, summed over the heads of a GQA group, then mean-pooled; window protected. */
static kvc_status score_edie(const layer_in *in, const kvc_score_args *a, float *const *scores) {
    if (!in->attn) return kvc_fail(KVC_ERR_ARG, "EDIE needs the attention outputs of the window queries");
    const int32_t g = in->H / in->Hkv, d = in->d, Hkv = in->Hkv;
    const int64_t w = in->m, ml = max_len(in);
    const float scale = 1.0f / sqrtf((float)d), alpha = a->edie_alpha;
    double *acc = malloc(sizeof(double) * (size_t)ml);
    float *probs = malloc(sizeof(float) * (size_t)w * (size_t)ml), *vnorm = malloc(sizeof(float) * (size_t)ml);
    float *tmp = malloc(sizeof(float) * (size_t)ml), *qw = malloc(sizeof(float) * (size_t)w * d);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)w), *n_acc = malloc(sizeof(int64_t) * (size_t)Hkv);
    kvc_status st = (!acc || !probs || !vnorm || !tmp || !qw || !vis || !n_acc)
                        ? kvc_fail(KVC_ERR_NOMEM, "out of memory: EDIE scores") : KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t len = in->len[h], n_past = len - w;
        n_acc[h] = n_past;
        for (int64_t r = 0; r < len; r++) {
            double s = 0;
            for (int32_t e = 0; e < d; e++) s += fabsf(in->v[h][r * d + e]);
            vnorm[r] = (float)s;
        }
        int64_t mid_lo = w + 1, mid_hi = len - 2 * w;
        if (mid_hi > n_past - 1) mid_hi = n_past - 1;
        if (mid_lo > mid_hi) {
            mid_lo = 0;
            mid_hi = n_past - 1;
        }
        memset(acc, 0, sizeof(double) * (size_t)len);
        for (int32_t t = 0; t < g; t++) {
            const int32_t hq = h * g + t;
            gather(in, hq, qw);
            visibility(in, h, vis);
            kvc_host_probs_rows(qw, w, in->k[h], len, d, scale, vis, probs);
            for (int64_t j = 0; j < w; j++) {
                const float *ar = probs + (size_t)j * len;
                const float *o = in->attn + j * in->ld_attn + (int64_t)hq * d;
                double onorm = 0;
                for (int32_t e = 0; e < d; e++) onorm += fabsf(o[e]);
                float cj = 0.f;
                for (int64_t r = mid_lo; r <= mid_hi; r++) cj = ar[r] > cj ? ar[r] : cj;
#pragma omp parallel for schedule(static)
                for (int64_t r = 0; r < n_past; r++) {
                    const double x = ar[r];
                    acc[r] += cj * (x / (1.0 + alpha - x)) * (vnorm[r] + onorm);
                }
            }
        }
        for (int64_t r = 0; r < n_past; r++) tmp[r] = (float)acc[r];
        pool1d(tmp, scores[h], n_past, a->kernel, 0); /* mean pooling, counting padding */
    }
    if (st == KVC_OK) protect_tail(in, n_acc, scores);
    free(acc); free(probs); free(vnorm); free(tmp); free(qw); free(vis); free(n_acc);
    return st;
}

static kvc_status score_host(const layer_in *in, const kvc_score_args *a, float *const *scores) {
    const int32_t Hkv = in->Hkv, d = in->d;
    switch (a->scorer) {
    case KVC_SCORE_SNAPKV:
        return score_window(in, a, 1, scores);
    case KVC_SCORE_PROBE:
        return score_window(in, a, 0, scores);
    case KVC_SCORE_EDIE:
        return score_edie(in, a, scores);
    case KVC_SCORE_TOVA:
        return score_tova(in, scores);
    case KVC_SCORE_KNORM:
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < in->len[h]; r++) {
                const float *k = in->k[h] + r * d;
                double s = 0;
                for (int32_t j = 0; j < d; j++) s += (double)k[j] * k[j];
                scores[h][r] = -(float)sqrt(s);
            }
        return KVC_OK;
    case KVC_SCORE_STREAMING:
        /* sinks first, then recency: top-k keeps the sinks and the most recent rows */
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < in->len[h]; r++) scores[h][r] = r < a->n_sink ? (float)(in->len[h] + 1) : (float)r;
        return KVC_OK;
    case KVC_SCORE_RANDOM:
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < in->len[h]; r++) scores[h][r] = kvc_random_score(a->seed, a->layer, h, r);
        return KVC_OK;
    default:
        return kvc_fail(KVC_ERR_UNSUPPORTED, "scorer %d is not a backend scorer", a->scorer);
    }
}

/* The table entry: the layer's rows and queries as f32 host arrays (copies for bf16 storage). */
kvc_status kvc_host_score_v(const kvc_score_args *a) {
    const int32_t Hkv = a->Hkv, H = a->H, d = a->d;
    const int needs_q = a->scorer == KVC_SCORE_SNAPKV || a->scorer == KVC_SCORE_EDIE || a->scorer == KVC_SCORE_TOVA ||
                        a->scorer == KVC_SCORE_PROBE;
    int64_t m = 0;
    if (a->scorer == KVC_SCORE_SNAPKV || a->scorer == KVC_SCORE_EDIE) m = a->window;
    else if (a->scorer == KVC_SCORE_TOVA) m = 1;
    else if (a->scorer == KVC_SCORE_PROBE) m = a->n;
    if (needs_q && (m < 1 || m > a->n))
        return kvc_fail(KVC_ERR_ARG, "the press window (%lld) needs that many queries in this call (%lld)", (long long)m,
                        (long long)a->n);
    kvc_kv_f32 kf;
    KVC_TRY(kvc_kv_f32_get(a->kv, a->scorer == KVC_SCORE_EDIE, 0, &kf));
    kvc_frows q = {0}, at = {0}, sc = {0};
    float **srow = calloc((size_t)Hkv, sizeof *srow);
    kvc_status st = srow ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    if (st == KVC_OK && needs_q) st = kvc_frows_get(kvc_view_at(a->q, a->n - m, 0), m, (int64_t)H * d, 1, &q);
    if (st == KVC_OK && a->scorer == KVC_SCORE_EDIE && a->attn.buf)
        st = kvc_frows_get(kvc_view_at(a->attn, a->n - m, 0), m, (int64_t)H * d, 1, &at);
    int64_t ml = 1;
    for (int32_t h = 0; h < Hkv; h++) ml = a->len[h] > ml ? a->len[h] : ml;
    if (st == KVC_OK) st = kvc_frows_get(a->scores, Hkv, ml, 0, &sc);
    if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) srow[h] = sc.p + h * sc.ld;
        const layer_in in = {H, Hkv, d, kf.k, kf.v, a->len, q.p, q.ld, m, a->scorer != KVC_SCORE_PROBE,
                             at.p, at.ld};
        st = score_host(&in, a, srow);
        if (st == KVC_OK) kvc_frows_put(a->scores, Hkv, ml, &sc);
    }
    kvc_frows_drop(&sc);
    kvc_frows_drop(&q);
    kvc_frows_drop(&at);
    free(srow);
    kvc_kv_f32_drop(a->kv, &kf);
    return st;
}
