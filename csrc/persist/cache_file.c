/* A saved KV cache: the safetensors file of cache_file.h, written and read through the cache's API
 * (cache/kv_cache.h) and the backend's row read/write; the project's safetensors reader checks its
 * structure before anything here reads a tensor. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../core/kv_type.h"
#include "../model/safetensors.h"
#include "cache_file.h"
#include "model_id.h"
#include "press_state.h"
#include "sha256.h"

/* What this build writes and the one it reads (kvpress_c.h). 3: the K/V storage type (kvc.kv_cache) and K/V in the
 * store's float type (F16, BF16; F32 for q8_0 and KIVI); 2: the presses' state (state.* tensors); 1: the cache
 * alone */
#define VERSION KVC_CACHE_FILE_VERSION
#define DIGEST_PREFIX "sha256:"
#define CORRUPT "; the file is corrupt"

struct kvc_cache_file {
    st_file *st;
    char *path;
};

/* ---- a growing string (the header) ---- */

typedef struct sbuf { char *s; size_t n, cap; int oom; } sbuf;

static void sb_put(sbuf *b, const char *p, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (b->n + n + 1 > cap) cap *= 2;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = 1;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
    memcpy(b->s + b->n, p, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *p) { sb_put(b, p, strlen(p)); }

static void sb_fmt(sbuf *b, const char *fmt, long long x, long long y) {
    char t[96];
    const int n = snprintf(t, sizeof t, fmt, x, y);
    sb_put(b, t, (size_t)n);
}

/* A JSON string: quotes, backslashes and control bytes escaped; UTF-8 passes as it is. */
static void sb_json(sbuf *b, const char *p) {
    sb_put(b, "\"", 1);
    for (; *p; p++) {
        const unsigned char ch = (unsigned char)*p;
        if (ch == '"' || ch == '\\') {
            const char e[2] = {'\\', (char)ch};
            sb_put(b, e, 2);
        } else if (ch < 0x20) {
            char e[8];
            snprintf(e, sizeof e, "\\u%04x", ch);
            sb_put(b, e, 6);
        } else {
            sb_put(b, p, 1);
        }
    }
    sb_put(b, "\"", 1);
}

/* ---- writing ---- */

/* The file's K/V dtype: the store's own where it is a float type (f32, f16, bf16: the rows read back are exact
 * in it), F32 for the quantised types (their decoded values). */
enum { KV_F32, KV_F16, KV_BF16 };
static int32_t file_kv_dtype(const kvc_cache *c) {
    const int32_t t = c->fmt.type == KVC_KV_NATIVE ? (c->be->act_dtype == KVC_BF16 ? KVC_KV_BF16 : KVC_KV_F32) : c->fmt.type;
    return t == KVC_KV_F16 ? KV_F16 : t == KVC_KV_BF16 ? KV_BF16 : KV_F32;
}
static const char *const kv_dtype_name[] = {"F32", "F16", "BF16"};

/* kvc.kv_cache: the storage type ("native", "f16", ..., KIVI's "kivi4,<group>,<residual>") */
static void kv_cache_name(const kvc_kv_format *f, char *out, size_t cap) {
    const char *name = f->type == KVC_KV_NATIVE ? "native" : kvc_kv_type_name(f->type);
    if (kvc_kv_type_key_blocks(f->type)) snprintf(out, cap, "%s,%d,%d", name, f->group, f->residual);
    else snprintf(out, cap, "%s", name);
}

static int kv_cache_parse(const char *s, kvc_kv_format *f) {
    char name[16];
    int g = 0, r = 0, used = 0;
    if (!s || sscanf(s, "%15[a-z0-9_]%n", name, &used) != 1) return 0;
    if (s[used] == ',' && sscanf(s + used, ",%d,%d", &g, &r) != 2) return 0;
    f->group = g;
    f->residual = r;
    if (!strcmp(name, "native")) f->type = KVC_KV_NATIVE;
    else {
        f->type = -2;
        for (int32_t t = 0; t < KVC_KV_N_TYPES; t++)
            if (!strcmp(name, kvc_kv_type_name(t))) f->type = t;
    }
    char back[48];
    kv_cache_name(f, back, sizeof back);
    return f->type != -2 && !strcmp(back, s); /* nothing else in the string */
}

typedef struct entry {
    char name[KVC_STATE_NAME];
    const char *dtype;
    int64_t shape[2];
    int32_t dims;
    size_t bytes, off;
    const void *data; /* a state array's values (the layers' come from the cache) */
} entry;

static void add_entry(entry *e, int32_t *n, size_t *off, const char *name, int32_t l, const char *dtype, size_t es,
                      int64_t s0, int64_t s1, int32_t dims) {
    entry *x = &e[(*n)++];
    snprintf(x->name, sizeof x->name, "layer.%d.%s", l, name);
    x->dtype = dtype;
    x->shape[0] = s0;
    x->shape[1] = s1;
    x->dims = dims;
    x->bytes = (size_t)s0 * (size_t)(dims > 1 ? s1 : 1) * es;
    x->off = *off;
    *off += x->bytes;
}

static int layer_pruned(const kvc_cache *c, const kvc_layer_cache *L) {
    for (int32_t h = 0; L->dk > 0 && h < c->n_kv; h++)
        if (L->np[h] > 0) return 1;
    return 0;
}

/* The presses' state arrays after the layers' tensors. */
static void add_state(entry *e, int32_t *n, size_t *off, const kvc_state_array *a) {
    entry *x = &e[(*n)++];
    memcpy(x->name, a->name, sizeof x->name);
    x->dtype = a->dtype == KVC_I64 ? "I64" : "F32";
    x->shape[0] = a->n;
    x->shape[1] = 0;
    x->dims = 1;
    x->bytes = (size_t)a->n * kvc_dtype_size(a->dtype);
    x->off = *off;
    x->data = a->data;
    *off += x->bytes;
}

/* The data section: every layer's tensors in entry order, then the state arrays. */
static kvc_status fill_data(const kvc_cache *c, const entry *e, int32_t ne, uint8_t *data, int32_t kvt) {
    for (int32_t i = 0; i < ne; i++)
        if (e[i].data && e[i].bytes) memcpy(data + e[i].off, e[i].data, e[i].bytes);
    const int32_t Hkv = c->n_kv, d = c->d;
    int64_t maxlen = 1;
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t h = 0; h < Hkv; h++) maxlen = c->layers[l].len[h] > maxlen ? c->layers[l].len[h] : maxlen;
    float *k = malloc(sizeof(float) * (size_t)maxlen * (size_t)d * 2);
    if (!k) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving the cache");
    float *v = k + (size_t)maxlen * (size_t)d;
    kvc_status st = KVC_OK;
    for (int32_t l = 0, ei = 0; l < c->n_layers && st == KVC_OK; l++) {
        const kvc_layer_cache *L = &c->layers[l];
        const entry *rows = &e[ei], *pos = &e[ei + 1], *ke = &e[ei + 2], *ve = &e[ei + 3];
        memcpy(data + rows->off, L->len, rows->bytes);
        size_t r0 = 0; /* rows written so far, head after head */
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const int64_t n = L->len[h];
            if (n == 0) continue;
            memcpy(data + pos->off + r0 * 8, L->pos[h], (size_t)n * 8);
            st = c->be->kv_read(L->kv, h, 0, n, k, v);
            for (int64_t i = 0; st == KVC_OK && i < n * d; i++) {
                const size_t at = (r0 * (size_t)d + (size_t)i) * (kvt != KV_F32 ? 2 : 4);
                if (kvt != KV_F32) { /* the store's values are of this type already: exact */
                    const uint16_t a = kvt == KV_F16 ? kvc_f32_to_f16(k[i]) : kvc_f32_to_bf16r(k[i]),
                                   b = kvt == KV_F16 ? kvc_f32_to_f16(v[i]) : kvc_f32_to_bf16r(v[i]);
                    memcpy(data + ke->off + at, &a, 2);
                    memcpy(data + ve->off + at, &b, 2);
                } else {
                    memcpy(data + ke->off + at, &k[i], 4);
                    memcpy(data + ve->off + at, &v[i], 4);
                }
            }
            r0 += (size_t)n;
        }
        ei += 4;
        if (layer_pruned(c, L)) {
            memcpy(data + e[ei].off, L->np, e[ei].bytes);
            memcpy(data + e[ei + 1].off, L->kidx, e[ei + 1].bytes);
            ei += 2;
        }
    }
    free(k);
    return st;
}

static kvc_status check_keys(int32_t n_meta, const char *const *keys, const char *const *values) {
    if (n_meta < 0 || (n_meta > 0 && (!keys || !values))) return kvc_fail(KVC_ERR_ARG, "saving a cache: bad metadata arrays");
    for (int32_t i = 0; i < n_meta; i++) {
        if (!keys[i] || !values[i] || !keys[i][0])
            return kvc_fail(KVC_ERR_ARG, "saving a cache: metadata entry %d has no key or no value", i);
        if (strncmp(keys[i], "kvc.", 4) == 0)
            return kvc_fail(KVC_ERR_ARG, "saving a cache: metadata key '%s' is reserved (keys starting with 'kvc.' are the "
                            "file's own)", keys[i]);
        for (int32_t j = 0; j < i; j++)
            if (strcmp(keys[i], keys[j]) == 0) return kvc_fail(KVC_ERR_ARG, "saving a cache: metadata key '%s' given twice", keys[i]);
    }
    return KVC_OK;
}

static kvc_status write_all(const char *path, const void *a, size_t na, const void *b, size_t nb) {
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return kvc_fail(KVC_ERR_ARG, "saving a cache: the path is too long");
    FILE *fp = fopen(tmp, "wb");
    if (!fp) return kvc_fail(KVC_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
    int bad = fwrite(a, 1, na, fp) != na || (nb && fwrite(b, 1, nb, fp) != nb);
    bad |= fclose(fp) != 0;
    if (bad || rename(tmp, path) != 0) {
        const int err = errno;
        remove(tmp);
        return kvc_fail(KVC_ERR_IO, "cannot write '%s': %s", path, strerror(err));
    }
    return KVC_OK;
}

kvc_status kvc_cache_file_write(const kvc_cache *c, const kvc_config *cfg, const char *model_digest, int64_t position,
                                const char *attached, const kvc_state_io *state, const char *path, int32_t n_meta,
                                const char *const *keys, const char *const *values) {
    if (!path || !*path) return kvc_fail(KVC_ERR_ARG, "saving a cache: no path");
    KVC_TRY(check_keys(n_meta, keys, values));
    const int32_t Hkv = c->n_kv, d = c->d, kvt = file_kv_dtype(c), n_state = state ? state->n : 0;
    const size_t es = kvt != KV_F32 ? 2 : 4;
    entry *e = calloc((size_t)c->n_layers * 6 + (size_t)n_state + 1, sizeof *e);
    if (!e) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving the cache");
    int32_t ne = 0;
    size_t off = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kvc_layer_cache *L = &c->layers[l];
        int64_t total = 0;
        for (int32_t h = 0; h < Hkv; h++) total += L->len[h];
        add_entry(e, &ne, &off, "rows", l, "I64", 8, Hkv, 0, 1);
        add_entry(e, &ne, &off, "positions", l, "I64", 8, total, 0, 1);
        add_entry(e, &ne, &off, "keys", l, kv_dtype_name[kvt], es, total, d, 2);
        add_entry(e, &ne, &off, "values", l, kv_dtype_name[kvt], es, total, d, 2);
        if (layer_pruned(c, L)) {
            add_entry(e, &ne, &off, "pruned_rows", l, "I64", 8, Hkv, 0, 1);
            add_entry(e, &ne, &off, "key_channels", l, "I32", 4, Hkv, L->dk, 2);
        }
    }
    for (int32_t i = 0; i < n_state; i++) add_state(e, &ne, &off, &state->arr[i]);
    uint8_t *data = calloc(off ? off : 1, 1);
    char *config = kvc_model_id_config_json(cfg);
    kvc_status st = data && config ? fill_data(c, e, ne, data, kvt) : kvc_fail(KVC_ERR_NOMEM, "out of memory: saving the cache");
    sbuf b = {0};
    size_t digest_at = 0;
    if (st == KVC_OK) {
        sb_put(&b, "\0\0\0\0\0\0\0\0", 8); /* the header's length, set below */
        sb_str(&b, "{\"__metadata__\":{\"kvc.format\":\"" KVC_CACHE_FORMAT "\",\"kvc.version\":");
        sb_fmt(&b, "\"%lld\",\"kvc.position\":\"%lld\",\"kvc.dtype\":", VERSION, position);
        sb_json(&b, kv_dtype_name[kvt]);
        char kvc_name[48];
        kv_cache_name(&c->fmt, kvc_name, sizeof kvc_name);
        sb_str(&b, ",\"kvc.kv_cache\":");
        sb_json(&b, kvc_name);
        sb_str(&b, ",\"kvc.device\":");
        sb_json(&b, c->be->name);
        sb_str(&b, ",\"kvc.presses\":");
        sb_json(&b, attached ? attached : "");
        sb_str(&b, ",\"kvc.model_config\":");
        sb_json(&b, config);
        sb_str(&b, ",\"kvc.model_digest\":");
        sb_json(&b, model_digest);
        for (int32_t i = 0; i < n_meta; i++) {
            sb_str(&b, ",");
            sb_json(&b, keys[i]);
            sb_str(&b, ":");
            sb_json(&b, values[i]);
        }
        sb_str(&b, ",\"kvc.digest\":\"" DIGEST_PREFIX);
        digest_at = b.n;
        sb_str(&b, "0000000000000000000000000000000000000000000000000000000000000000\"}");
        for (int32_t i = 0; i < ne; i++) {
            sb_str(&b, ",");
            sb_json(&b, e[i].name);
            sb_str(&b, ":{\"dtype\":");
            sb_json(&b, e[i].dtype);
            if (e[i].dims == 1) sb_fmt(&b, ",\"shape\":[%lld]", e[i].shape[0], 0);
            else sb_fmt(&b, ",\"shape\":[%lld,%lld]", e[i].shape[0], e[i].shape[1]);
            sb_fmt(&b, ",\"data_offsets\":[%lld,%lld]}", (long long)e[i].off, (long long)(e[i].off + e[i].bytes));
        }
        sb_str(&b, "}");
        while (b.n % 8) sb_str(&b, " "); /* the data section starts 8-aligned */
        if (b.oom) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: saving the cache");
    }
    if (st == KVC_OK) {
        const uint64_t hlen = b.n - 8;
        for (int i = 0; i < 8; i++) b.s[i] = (char)(hlen >> (8 * i));
        kvc_sha256 h;
        kvc_sha256_init(&h);
        kvc_sha256_update(&h, b.s, b.n);
        kvc_sha256_update(&h, data, off);
        char hex[65];
        kvc_sha256_hex(&h, hex);
        memcpy(b.s + digest_at, hex, 64);
        st = write_all(path, b.s, b.n, data, off);
    }
    free(b.s);
    free(config);
    free(data);
    free(e);
    return st;
}

/* ---- reading ---- */

/* A decimal integer in [0, max], the whole string; -1 otherwise. */
static int64_t parse_count(const char *s, int64_t max) {
    if (!s || !*s || strlen(s) > 18) return -1;
    int64_t x = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9') return -1;
        x = x * 10 + (*p - '0');
    }
    return x <= max ? x : -1;
}

static kvc_status check_digest(const kvc_cache_file *f) {
    const char *dg = st_meta(f->st, "kvc.digest");
    const size_t np = strlen(DIGEST_PREFIX);
    int ok = dg && strlen(dg) == np + 64 && strncmp(dg, DIGEST_PREFIX, np) == 0;
    for (size_t i = 0; ok && i < 64; i++) ok = (dg[np + i] >= '0' && dg[np + i] <= '9') || (dg[np + i] >= 'a' && dg[np + i] <= 'f');
    if (!ok) return kvc_fail(KVC_ERR_FORMAT, "'%s': its kvc.digest is missing or not a SHA-256" CORRUPT, f->path);
    size_t size, data_off;
    const uint8_t *bytes = st_bytes(f->st, &size, &data_off);
    const uint8_t *at = NULL; /* the digest's hex digits in the header (random: found once) */
    for (const uint8_t *p = bytes + 8; p + 64 <= bytes + data_off; p++)
        if (*p == (uint8_t)dg[np] && memcmp(p, dg + np, 64) == 0) {
            if (at) return kvc_fail(KVC_ERR_FORMAT, "'%s': its digest appears twice in the header" CORRUPT, f->path);
            at = p;
        }
    if (!at) return kvc_fail(KVC_ERR_FORMAT, "'%s': its digest is escaped in the header" CORRUPT, f->path);
    static const char zeros[64] = "0000000000000000000000000000000000000000000000000000000000000000";
    kvc_sha256 h;
    kvc_sha256_init(&h);
    kvc_sha256_update(&h, bytes, (size_t)(at - bytes));
    kvc_sha256_update(&h, zeros, 64);
    kvc_sha256_update(&h, at + 64, size - (size_t)(at - bytes) - 64);
    char hex[65];
    kvc_sha256_hex(&h, hex);
    if (memcmp(hex, dg + np, 64) != 0)
        return kvc_fail(KVC_ERR_FORMAT, "'%s' is corrupt: its SHA-256 digest does not match its bytes (the file was "
                        "changed or damaged after it was saved)", f->path);
    return KVC_OK;
}

kvc_status kvc_cache_file_open(const char *path, kvc_cache_file **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_cache_file_open: out is NULL");
    *out = NULL;
    if (!path) return kvc_fail(KVC_ERR_ARG, "kvc_cache_file_open: path is NULL");
    kvc_cache_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory opening '%s'", path);
    }
    kvc_status st = st_open(path, &f->st);
    const char *fmt = st == KVC_OK ? st_meta(f->st, "kvc.format") : NULL;
    if (st == KVC_OK && (!fmt || strcmp(fmt, KVC_CACHE_FORMAT) != 0))
        st = kvc_fail(KVC_ERR_FORMAT, "'%s' is not a kvpress_c cache file (its metadata has no kvc.format \"%s\")", path,
                      KVC_CACHE_FORMAT);
    if (st == KVC_OK) {
        const int64_t v = parse_count(st_meta(f->st, "kvc.version"), INT32_MAX);
        if (v < 1) st = kvc_fail(KVC_ERR_FORMAT, "'%s': its kvc.version is not a format version" CORRUPT, path);
        else if (v > VERSION)
            st = kvc_fail(KVC_ERR_FORMAT, "'%s' is cache format version %lld, newer than this kvpress_c reads (version %d): "
                          "upgrade kvpress_c to load it", path, (long long)v, VERSION);
        else if (v < VERSION)
            st = kvc_fail(KVC_ERR_FORMAT, "'%s' is cache format version %lld, older than this kvpress_c reads (version %d, "
                          "which keeps the presses' state mid-answer): compress and save the context again, or load it "
                          "with the kvpress_c that saved it", path, (long long)v, VERSION);
    }
    if (st == KVC_OK) st = check_digest(f);
    if (st != KVC_OK) {
        kvc_cache_file_close(f);
        return st;
    }
    *out = f;
    return KVC_OK;
}

void kvc_cache_file_close(kvc_cache_file *f) {
    if (!f) return;
    st_close(f->st);
    free(f->path);
    free(f);
}

kvc_status kvc_cache_file_meta_json(const kvc_cache_file *f, char *out, size_t cap, size_t *needed) {
    if (!f || !needed || (cap && !out)) return kvc_fail(KVC_ERR_ARG, "kvc_cache_file_meta_json: null argument");
    sbuf b = {0};
    sb_str(&b, "{");
    for (size_t i = 0; i < st_meta_count(f->st); i++) {
        const char *v, *k = st_meta_at(f->st, i, &v);
        if (i) sb_str(&b, ",");
        sb_json(&b, k);
        sb_str(&b, ":");
        sb_json(&b, v);
    }
    sb_str(&b, "}");
    if (b.oom) {
        free(b.s);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: cache metadata");
    }
    *needed = b.n + 1;
    if (cap >= b.n + 1) memcpy(out, b.s, b.n + 1);
    free(b.s);
    return KVC_OK;
}

/* A tensor of the file with the given dtype(s) and shape (s1 < 0: one dimension), or NULL with the error set. */
static const st_tensor *tensor(const kvc_cache_file *f, int32_t l, const char *name, const char *dtype, int64_t s0,
                               int64_t s1, int optional) {
    char full[KVC_STATE_NAME];
    snprintf(full, sizeof full, "layer.%d.%s", l, name);
    const st_tensor *t = st_find(f->st, full);
    if (!t) {
        if (!optional) kvc_fail(KVC_ERR_FORMAT, "'%s' has no tensor %s" CORRUPT, f->path, full);
        return NULL;
    }
    const int dims = s1 < 0 ? 1 : 2;
    const int dtype_ok = strcmp(dtype, "KV") == 0 ? (t->dtype == ST_F32 || t->dtype == ST_BF16 || t->dtype == ST_F16)
                                                  : strcmp(t->dtype_name, dtype) == 0;
    if (!dtype_ok || t->n_dims != dims || t->shape[0] != s0 || (dims == 2 && t->shape[1] != s1)) {
        kvc_fail(KVC_ERR_FORMAT, "'%s': tensor %s is %s with %d dimensions, not the %s [%lld%s] this cache needs" CORRUPT,
                 f->path, full, t->dtype_name, t->n_dims, dtype, (long long)s0, dims == 2 ? ", d" : "");
        return NULL;
    }
    return t;
}

static int64_t i64_at(const st_tensor *t, int64_t i) {
    int64_t x;
    memcpy(&x, (const uint8_t *)t->data + 8 * i, 8);
    return x;
}

/* One layer's tensors, checked: lengths, positions inside [0, position), ThinK's channels. */
typedef struct layer_in {
    const st_tensor *rows, *pos, *k, *v, *np, *kidx;
    int64_t total;
    int32_t dk;
} layer_in;

static kvc_status check_layer(const kvc_cache_file *f, int32_t l, int32_t Hkv, int32_t d, int64_t position, layer_in *in) {
    memset(in, 0, sizeof *in);
    if (!(in->rows = tensor(f, l, "rows", "I64", Hkv, -1, 0))) return KVC_ERR_FORMAT;
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t n = i64_at(in->rows, h);
        if (n < 0 || n > position)
            return kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d head %d holds %lld rows of a %lld-token sequence" CORRUPT, f->path,
                            l, h, (long long)n, (long long)position);
        in->total += n;
    }
    if (!(in->pos = tensor(f, l, "positions", "I64", in->total, -1, 0))) return KVC_ERR_FORMAT;
    for (int64_t i = 0; i < in->total; i++)
        if (i64_at(in->pos, i) < 0 || i64_at(in->pos, i) >= position)
            return kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d has a row at position %lld, outside [0, %lld)" CORRUPT, f->path, l,
                            (long long)i64_at(in->pos, i), (long long)position);
    if (!(in->k = tensor(f, l, "keys", "KV", in->total, d, 0)) || !(in->v = tensor(f, l, "values", "KV", in->total, d, 0)))
        return KVC_ERR_FORMAT;
    in->np = tensor(f, l, "pruned_rows", "I64", Hkv, -1, 1);
    char name[48];
    snprintf(name, sizeof name, "layer.%d.key_channels", l);
    const st_tensor *kc = st_find(f->st, name);
    if (!in->np != !kc) return kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d has only one of pruned_rows and key_channels" CORRUPT, f->path, l);
    if (!kc) return KVC_OK;
    if (kc->n_dims != 2 || kc->shape[1] < 1 || kc->shape[1] > d) {
        kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d keeps a number of key channels outside [1, %d]" CORRUPT, f->path, l, d);
        return KVC_ERR_FORMAT;
    }
    in->dk = (int32_t)kc->shape[1];
    if (!(in->kidx = tensor(f, l, "key_channels", "I32", Hkv, in->dk, 0))) return KVC_ERR_FORMAT;
    for (int32_t h = 0; h < Hkv; h++) {
        if (i64_at(in->np, h) < 0 || i64_at(in->np, h) > i64_at(in->rows, h))
            return kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d head %d has more pruned rows than rows" CORRUPT, f->path, l, h);
        for (int32_t j = 0; j < in->dk; j++) {
            int32_t c, p = -1;
            memcpy(&c, (const uint8_t *)in->kidx->data + 4 * ((size_t)h * in->dk + j), 4);
            if (j) memcpy(&p, (const uint8_t *)in->kidx->data + 4 * ((size_t)h * in->dk + j - 1), 4);
            if (c < 0 || c >= d || c <= p)
                return kvc_fail(KVC_ERR_FORMAT, "'%s': layer %d head %d's key channels are not increasing in [0, %d)" CORRUPT,
                                f->path, l, h, d);
        }
    }
    return KVC_OK;
}

/* One layer into the cache: the rows converted to f32 head by head. */
static kvc_status load_layer(kvc_cache *c, int32_t l, const layer_in *in) {
    const int32_t Hkv = c->n_kv, d = c->d;
    int64_t *len = malloc(sizeof(int64_t) * (size_t)Hkv * 2), *np = len ? len + Hkv : NULL;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(in->total ? in->total : 1));
    float *k = malloc(sizeof(float) * (size_t)(in->total ? in->total : 1) * (size_t)d * 2);
    int32_t *kidx = malloc(sizeof(int32_t) * (size_t)Hkv * (size_t)(in->dk ? in->dk : 1));
    const int64_t **hp = malloc(sizeof *hp * (size_t)Hkv);
    const float **hk = malloc(sizeof *hk * (size_t)Hkv * 2);
    kvc_status st = len && pos && k && kidx && hp && hk ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: loading a cache");
    if (st == KVC_OK) {
        float *v = k + (size_t)in->total * d;
        if (in->total) memcpy(pos, in->pos->data, sizeof(int64_t) * (size_t)in->total);
        st = st_to_f32(in->k, k);
        if (st == KVC_OK) st = st_to_f32(in->v, v);
        int64_t r0 = 0;
        for (int32_t h = 0; h < Hkv; h++) {
            len[h] = i64_at(in->rows, h);
            np[h] = in->np ? i64_at(in->np, h) : 0;
            hp[h] = pos + r0;
            hk[h] = k + r0 * d;
            hk[Hkv + h] = v + r0 * d;
            r0 += len[h];
        }
        if (in->dk) memcpy(kidx, in->kidx->data, sizeof(int32_t) * (size_t)Hkv * (size_t)in->dk);
    }
    if (st == KVC_OK) st = kvc_cache_load_layer(c, l, len, hp, hk, hk + Hkv, in->dk, kidx, np);
    free(len);
    free(pos);
    free(k);
    free(kidx);
    free(hp);
    free(hk);
    return st;
}

kvc_status kvc_cache_file_load(const kvc_cache_file *f, const kvc_config *cfg, const char *here,
                               const kvc_kv_format *as, kvc_cache *c, int64_t *position) {
    if (!f || !cfg || !here || !c || !position) return kvc_fail(KVC_ERR_ARG, "kvc_cache_file_load: null argument");
    if (!kvc_cache_is_empty(c)) return kvc_fail(KVC_ERR_ARG, "loading a saved cache into a session that holds rows: reset() it first");
    const char *config = st_meta(f->st, "kvc.model_config"), *digest = st_meta(f->st, "kvc.model_digest");
    if (!config || !digest) return kvc_fail(KVC_ERR_FORMAT, "'%s' does not say which model it was saved from" CORRUPT, f->path);
    KVC_TRY(kvc_model_id_check_config(cfg, config, f->path));
    if (strcmp(here, digest) != 0)
        return kvc_fail(KVC_ERR_FORMAT, "'%s' was saved from a different model: its weights' digest is %.40s..., this "
                        "model's %.40s... (same configuration, other weights)", f->path, digest, here);
    const int64_t pos = parse_count(st_meta(f->st, "kvc.position"), INT64_MAX / 2);
    if (pos < 0) return kvc_fail(KVC_ERR_FORMAT, "'%s': its kvc.position is not a position" CORRUPT, f->path);
    /* the storage type it was saved in */
    kvc_kv_format fmt = c->fmt, old = c->fmt;
    const char *kvc_name = st_meta(f->st, "kvc.kv_cache");
    if (parse_count(st_meta(f->st, "kvc.version"), INT32_MAX) >= 3 &&
        (!kv_cache_parse(kvc_name, &fmt) || kvc_kv_format_check(&fmt, c->d) != KVC_OK))
        return kvc_fail(KVC_ERR_FORMAT, "'%s': its kvc.kv_cache '%s' is not a K/V cache type" CORRUPT, f->path,
                        kvc_name ? kvc_name : "");
    if (as) fmt = *as; /* the rows (f32 as read) are stored as any append stores them */
    layer_in *in = calloc((size_t)c->n_layers, sizeof *in);
    if (!in) return kvc_fail(KVC_ERR_NOMEM, "out of memory: loading a cache");
    kvc_status st = KVC_OK;
    int64_t expected = 0;
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++) {
        st = check_layer(f, l, c->n_kv, c->d, pos, &in[l]);
        expected += in[l].dk ? 6 : 4;
    }
    for (int64_t i = 0; i < st_n_tensors(f->st) && st == KVC_OK; i++) { /* the presses' state: read by the presses */
        const st_tensor *t = st_tensor_at(f->st, i);
        if (strncmp(t->name, KVC_STATE_PREFIX, strlen(KVC_STATE_PREFIX)) != 0) continue;
        st = kvc_state_check_tensor(t, f->path);
        expected++;
    }
    if (st == KVC_OK && st_n_tensors(f->st) != expected)
        st = kvc_fail(KVC_ERR_FORMAT, "'%s' holds %lld tensors, not the %lld of a %d-layer cache" CORRUPT, f->path,
                      (long long)st_n_tensors(f->st), (long long)expected, c->n_layers);
    if (st == KVC_OK && memcmp(&fmt, &c->fmt, sizeof fmt)) st = kvc_cache_set_format(c, &fmt); /* the device may refuse it */
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++) st = load_layer(c, l, &in[l]);
    free(in);
    if (st != KVC_OK) {
        kvc_cache_clear(c);
        if (memcmp(&old, &c->fmt, sizeof old)) kvc_cache_set_format(c, &old); /* the session keeps its own type */
        return st;
    }
    *position = pos;
    return KVC_OK;
}

kvc_status kvc_cache_file_state(const kvc_cache_file *f, kvc_state_io *io) {
    if (!f || !io) return kvc_fail(KVC_ERR_ARG, "kvc_cache_file_state: null argument");
    return kvc_state_reader_init(io, f->st, f->path);
}
