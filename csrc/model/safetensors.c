/* safetensors reader: 8-byte little-endian header length, JSON header, raw little-endian data.
 * Memory-mapped; the whole header is validated before any tensor is touched: known dtype, at most
 * 8 non-negative dims, data_offsets inside the data section, end - begin == product(shape) x dtype
 * size (overflow-checked), no two tensors sharing bytes, no duplicate names (the JSON parser
 * rejects duplicate keys). Unused bytes in the data section are tolerated. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "convert.h"
#include "json.h"
#include "safetensors.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a little-endian host"
#endif

#define MAX_HEADER ((uint64_t)100 << 20) /* the limit the reference implementation uses */
#define HINT "; the file may be truncated or corrupt"

struct st_file {
    uint8_t *map;
    size_t size;
    st_tensor *tensors; /* header order */
    int64_t n;
    const st_tensor **by_name; /* sorted by name, for st_find */
    char *path;
    size_t data_off;           /* 8 + the header's length */
    char **meta;               /* __metadata__: key, value, key, value ... (header order) */
    size_t n_meta;
};

static int dtype_of(const char *s, st_dtype *dt, size_t *bytes) {
    static const struct { const char *name; st_dtype dt; size_t bytes; } table[] = {
        {"F32", ST_F32, 4},      {"F16", ST_F16, 2},         {"BF16", ST_BF16, 2},      {"F64", ST_OTHER, 8},
        {"I64", ST_OTHER, 8},    {"I32", ST_OTHER, 4},       {"I16", ST_OTHER, 2},      {"I8", ST_OTHER, 1},
        {"U64", ST_OTHER, 8},    {"U32", ST_OTHER, 4},       {"U16", ST_OTHER, 2},      {"U8", ST_OTHER, 1},
        {"BOOL", ST_OTHER, 1},   {"F8_E4M3", ST_OTHER, 1},   {"F8_E5M2", ST_OTHER, 1},  {"F8_E8M0", ST_OTHER, 1},
        {"C64", ST_OTHER, 8}};
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (strcmp(s, table[i].name) == 0) {
            *dt = table[i].dt;
            *bytes = table[i].bytes;
            return 1;
        }
    return 0;
}

/* A JSON number that is an exact integer in [0, 2^53] (beyond that doubles skip integers). */
static int as_index(const json_value *v, uint64_t *out) {
    if (v->kind != JSON_NUMBER || !(v->number >= 0) || v->number > 9007199254740992.0 || v->number != floor(v->number))
        return 0;
    *out = (uint64_t)v->number;
    return 1;
}

typedef struct { uint64_t begin, end; int64_t idx; } range;

static int range_cmp(const void *a, const void *b) {
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

static int name_cmp(const void *a, const void *b) {
    return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

/* One header entry -> f->tensors[f->n] (n incremented once the name is owned, so st_close frees it). */
static kvc_status parse_entry(st_file *f, const char *name, const json_value *e, uint64_t data_size, size_t data_off) {
    const json_value *dt = json_get(e, "dtype"), *shape = json_get(e, "shape"), *offs = json_get(e, "data_offsets");
    if (e->kind != JSON_OBJECT || !dt || dt->kind != JSON_STRING || !shape || shape->kind != JSON_ARRAY || !offs ||
        offs->kind != JSON_ARRAY || offs->n != 2)
        return kvc_fail(KVC_ERR_FORMAT,
                        "safetensors '%s': tensor '%s' needs \"dtype\" (string), \"shape\" (list) and \"data_offsets\" "
                        "[begin, end]" HINT, f->path, name);
    st_tensor *t = &f->tensors[f->n];
    if (!(t->name = strdup(name))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: safetensors header");
    f->n++;
    size_t es;
    if (strlen(dt->string) != dt->string_len || !dtype_of(dt->string, &t->dtype, &es))
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has unknown dtype '%.32s'" HINT, f->path, name,
                        dt->string);
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dt->string);
    if (shape->n > 8)
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has %zu dimensions (at most 8 are supported)" HINT,
                        f->path, name, shape->n);
    t->n_dims = (int32_t)shape->n;
    size_t count = 1;
    for (size_t k = 0; k < shape->n; k++) {
        uint64_t d;
        if (!as_index(&shape->items[k], &d))
            return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has an invalid shape (dimension %zu is not a "
                            "non-negative integer)" HINT, f->path, name, k);
        if (kvc_mul_ok(count, (size_t)d, &count) != 0 || count > (size_t)INT64_MAX)
            return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has a shape whose size overflows" HINT, f->path,
                            name);
        t->shape[k] = (int64_t)d;
    }
    t->n_elements = (int64_t)count;
    uint64_t b, en;
    if (!as_index(&offs->items[0], &b) || !as_index(&offs->items[1], &en))
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has data_offsets that are not non-negative integers" HINT,
                        f->path, name);
    if (en < b || en > data_size)
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has data_offsets [%llu, %llu] outside the %llu-byte "
                        "data section" HINT, f->path, name, (unsigned long long)b, (unsigned long long)en,
                        (unsigned long long)data_size);
    size_t nbytes;
    if (kvc_mul_ok(count, es, &nbytes) != 0 || nbytes != en - b)
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has %llu data bytes but shape x %s needs %zu x %zu" HINT,
                        f->path, name, (unsigned long long)(en - b), t->dtype_name, count, es);
    t->data = f->map + data_off + (size_t)b;
    t->nbytes = nbytes;
    return KVC_OK;
}

static kvc_status parse_header(st_file *f, const json_value *hdr, size_t data_off) {
    const uint64_t data_size = f->size - data_off;
    if (hdr->kind != JSON_OBJECT)
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': the header is not a JSON object" HINT, f->path);
    const size_t cap = hdr->n ? hdr->n : 1;
    f->tensors = calloc(cap, sizeof(st_tensor));
    f->by_name = malloc(cap * sizeof *f->by_name);
    range *ranges = malloc(cap * sizeof(range));
    if (!f->tensors || !f->by_name || !ranges) {
        free(ranges);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: safetensors header of '%s'", f->path);
    }
    kvc_status st = KVC_OK;
    for (size_t i = 0; i < hdr->n && st == KVC_OK; i++) {
        const json_value *e = &hdr->items[i];
        if (strcmp(hdr->keys[i], "__metadata__") == 0) { /* free-form string -> string map */
            int ok = e->kind == JSON_OBJECT;
            for (size_t k = 0; ok && k < e->n; k++) ok = e->items[k].kind == JSON_STRING;
            if (!ok) st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': __metadata__ must map strings to strings" HINT, f->path);
            if (ok && e->n && !(f->meta = calloc(2 * e->n, sizeof *f->meta)))
                st = kvc_fail(KVC_ERR_NOMEM, "out of memory: safetensors metadata of '%s'", f->path);
            for (size_t k = 0; ok && f->meta && k < e->n && st == KVC_OK; k++, f->n_meta++)
                if (!(f->meta[2 * k] = strdup(e->keys[k])) || !(f->meta[2 * k + 1] = strdup(e->items[k].string)))
                    st = kvc_fail(KVC_ERR_NOMEM, "out of memory: safetensors metadata of '%s'", f->path);
            continue;
        }
        st = parse_entry(f, hdr->keys[i], e, data_size, data_off);
    }
    /* overlap: sort by begin; empty tensors occupy no bytes and are skipped */
    int64_t nr = 0;
    for (int64_t i = 0; st == KVC_OK && i < f->n; i++) {
        const st_tensor *t = &f->tensors[i];
        if (t->nbytes == 0) continue;
        const uint64_t b = (uint64_t)((const uint8_t *)t->data - (f->map + data_off));
        ranges[nr++] = (range){b, b + t->nbytes, i};
    }
    if (st == KVC_OK && nr > 1) {
        qsort(ranges, (size_t)nr, sizeof(range), range_cmp);
        for (int64_t i = 1; i < nr && st == KVC_OK; i++)
            if (ranges[i].begin < ranges[i - 1].end)
                st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensors '%s' and '%s' share bytes [%llu, %llu)" HINT, f->path,
                              f->tensors[ranges[i - 1].idx].name, f->tensors[ranges[i].idx].name,
                              (unsigned long long)ranges[i].begin,
                              (unsigned long long)(ranges[i].end < ranges[i - 1].end ? ranges[i].end : ranges[i - 1].end));
    }
    free(ranges);
    if (st == KVC_OK) {
        for (int64_t i = 0; i < f->n; i++) f->by_name[i] = &f->tensors[i];
        if (f->n > 1) qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, name_cmp);
    }
    return st;
}

kvc_status st_open(const char *path, st_file **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "st_open: out is NULL");
    *out = NULL;
    if (!path) return kvc_fail(KVC_ERR_ARG, "st_open: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kvc_fail(KVC_ERR_IO, "'%s' is not a regular file", path);
    }
    if (sb.st_size < 10) { /* 8-byte length + "{}" */
        close(fd);
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s' is too small (%lld bytes)" HINT, path, (long long)sb.st_size);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return kvc_fail(KVC_ERR_IO, "cannot map '%s': %s", path, strerror(map_errno));
    st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        munmap(map, (size_t)sb.st_size);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory opening '%s'", path);
    }
    f->map = map;
    f->size = (size_t)sb.st_size;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->map[i];
    kvc_status st = KVC_OK;
    if (hlen < 2 || hlen > MAX_HEADER || hlen > f->size - 8)
        st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': header length %llu does not fit the %zu-byte file (at most %llu)" HINT,
                      path, (unsigned long long)hlen, f->size, (unsigned long long)MAX_HEADER);
    json_value *hdr = NULL;
    char what[600];
    snprintf(what, sizeof what, "safetensors header of '%.500s'", path);
    if (st == KVC_OK) st = json_parse((const char *)f->map + 8, (size_t)hlen, what, &hdr);
    f->data_off = 8 + (size_t)hlen;
    if (st == KVC_OK) st = parse_header(f, hdr, f->data_off);
    json_free(hdr);
    if (st != KVC_OK) {
        st_close(f);
        return st;
    }
    *out = f;
    return KVC_OK;
}

void st_close(st_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(f->by_name);
    for (size_t i = 0; i < 2 * f->n_meta; i++) free(f->meta[i]);
    free(f->meta);
    if (f->map) munmap(f->map, f->size);
    free(f->path);
    free(f);
}

const char *st_meta(const st_file *f, const char *key) {
    for (size_t i = 0; f && key && i < f->n_meta; i++)
        if (f->meta[2 * i] && strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

size_t st_meta_count(const st_file *f) { return f ? f->n_meta : 0; }

const char *st_meta_at(const st_file *f, size_t i, const char **value) {
    if (!f || i >= f->n_meta) return NULL;
    *value = f->meta[2 * i + 1];
    return f->meta[2 * i];
}

const uint8_t *st_bytes(const st_file *f, size_t *size, size_t *data_off) {
    *size = f ? f->size : 0;
    *data_off = f ? f->data_off : 0;
    return f ? f->map : NULL;
}

int64_t st_n_tensors(const st_file *f) { return f ? f->n : 0; }

const st_tensor *st_tensor_at(const st_file *f, int64_t i) {
    return (f && i >= 0 && i < f->n) ? &f->tensors[i] : NULL;
}

const st_tensor *st_find(const st_file *f, const char *name) {
    if (!f || !name) return NULL;
    int64_t lo = 0, hi = f->n; /* binary search over by_name */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        const st_tensor *t = f->by_name[mid];
        const int c = strcmp(t->name, name);
        if (c == 0) return t;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

kvc_status st_to_f32(const st_tensor *t, float *dst) { return st_range_to_f32(t, 0, t ? t->n_elements : 0, dst); }

kvc_status st_range_to_f32(const st_tensor *t, int64_t first, int64_t n, float *dst) {
    if (!t || (!dst && n)) return kvc_fail(KVC_ERR_ARG, "st_to_f32: null argument");
    if (first < 0 || n < 0 || first + n > t->n_elements)
        return kvc_fail(KVC_ERR_ARG, "st_to_f32: elements [%lld, %lld) outside tensor '%s'", (long long)first,
                        (long long)(first + n), t->name);
    switch (t->dtype) {
    case ST_F32:
        if (n) memcpy(dst, (const uint8_t *)t->data + 4 * first, (size_t)n * 4); /* data may be unaligned: memcpy */
        return KVC_OK;
    case ST_F16: {
        const uint8_t *s = (const uint8_t *)t->data + 2 * first;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kvc_f16_to_f32(h);
        }
        return KVC_OK;
    }
    case ST_BF16: {
        const uint8_t *s = (const uint8_t *)t->data + 2 * first;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kvc_bf16_to_f32(h);
        }
        return KVC_OK;
    }
    default:
        return kvc_fail(KVC_ERR_UNSUPPORTED, "tensor '%s' has dtype %s; only F32, F16 and BF16 weights are supported",
                        t->name, t->dtype_name);
    }
}
