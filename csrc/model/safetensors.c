/* safetensors reader: 8-byte header length, JSON header, raw little-endian data. Memory-mapped; the
 * header is validated before any tensor is touched (dtype, shape, offsets inside the data section,
 * size = product(shape) x dtype size, no overlaps). */
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "convert.h"
#include "json.h"
#include "safetensors.h"

#define MAX_HEADER (100u << 20)
#define HINT "; the file may be truncated or corrupt"

struct st_file {
    uint8_t *map;
    size_t size;
    st_tensor *tensors;
    int64_t n;
    char *path;
};

static int dtype_of(const char *s, st_dtype *dt, size_t *bytes) {
    static const struct { const char *name; st_dtype dt; size_t bytes; } table[] = {
        {"F32", ST_F32, 4}, {"F16", ST_F16, 2}, {"BF16", ST_BF16, 2}, {"F64", ST_OTHER, 8}, {"I64", ST_OTHER, 8},
        {"I32", ST_OTHER, 4}, {"I16", ST_OTHER, 2}, {"I8", ST_OTHER, 1}, {"U8", ST_OTHER, 1}, {"U16", ST_OTHER, 2},
        {"U32", ST_OTHER, 4}, {"U64", ST_OTHER, 8}, {"BOOL", ST_OTHER, 1}, {"F8_E4M3", ST_OTHER, 1}, {"F8_E5M2", ST_OTHER, 1}};
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (strcmp(s, table[i].name) == 0) {
            *dt = table[i].dt;
            *bytes = table[i].bytes;
            return 1;
        }
    return 0;
}

typedef struct { size_t begin, end; int64_t idx; } range;

static int range_cmp(const void *a, const void *b) {
    const range *x = a, *y = b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

static kvc_status parse_header(st_file *f, const json_value *hdr, size_t data_off) {
    const size_t data_size = f->size - data_off;
    if (hdr->kind != JSON_OBJECT) return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': the header is not a JSON object" HINT, f->path);
    f->tensors = calloc(hdr->n ? hdr->n : 1, sizeof(st_tensor));
    range *ranges = malloc(sizeof(range) * (hdr->n ? hdr->n : 1));
    if (!f->tensors || !ranges) {
        free(ranges);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: safetensors header");
    }
    kvc_status st = KVC_OK;
    int64_t nr = 0;
    for (size_t i = 0; i < hdr->n && st == KVC_OK; i++) {
        const char *name = hdr->keys[i];
        const json_value *e = &hdr->items[i];
        if (strcmp(name, "__metadata__") == 0) {
            if (e->kind != JSON_OBJECT) st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': __metadata__ must be an object" HINT, f->path);
            continue;
        }
        const json_value *dt = json_get(e, "dtype"), *shape = json_get(e, "shape"), *offs = json_get(e, "data_offsets");
        if (e->kind != JSON_OBJECT || !dt || dt->kind != JSON_STRING || !shape || shape->kind != JSON_ARRAY || !offs ||
            offs->kind != JSON_ARRAY || offs->n != 2) {
            st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' needs dtype, shape and data_offsets [begin, end]" HINT, f->path, name);
            break;
        }
        for (int64_t j = 0; j < f->n; j++)
            if (strcmp(f->tensors[j].name, name) == 0) {
                st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': duplicate tensor '%s'" HINT, f->path, name);
                break;
            }
        if (st != KVC_OK) break;
        st_tensor *t = &f->tensors[f->n];
        t->name = strdup(name);
        if (!t->name) {
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory");
            break;
        }
        f->n++;
        size_t es;
        if (!dtype_of(dt->string, &t->dtype, &es)) {
            st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has unknown dtype '%s'" HINT, f->path, name, dt->string);
            break;
        }
        snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dt->string);
        if (shape->n > 8) {
            st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has %zu dimensions (at most 8)" HINT, f->path, name, shape->n);
            break;
        }
        t->n_dims = (int32_t)shape->n;
        size_t count = 1;
        for (size_t k = 0; k < shape->n && st == KVC_OK; k++) {
            const json_value *d = &shape->items[k];
            if (d->kind != JSON_NUMBER || d->number < 0 || d->number != floor(d->number) || d->number > 9.0e15 ||
                kvc_mul_ok(count, (size_t)d->number, &count)) {
                st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' has an invalid shape" HINT, f->path, name);
                break;
            }
            t->shape[k] = (int64_t)d->number;
        }
        if (st != KVC_OK) break;
        t->n_elements = (int64_t)count;
        double b = offs->items[0].number, en = offs->items[1].number;
        if (offs->items[0].kind != JSON_NUMBER || offs->items[1].kind != JSON_NUMBER || b < 0 || en < b ||
            b != floor(b) || en != floor(en) || en > (double)data_size) {
            st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' data_offsets [%.0f, %.0f] lie outside the %zu-byte data section" HINT,
                          f->path, name, b, en, data_size);
            break;
        }
        size_t nbytes;
        if (kvc_mul_ok(count, es, &nbytes) || nbytes != (size_t)(en - b)) {
            st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensor '%s' holds %.0f bytes but its shape and dtype need %zu" HINT,
                          f->path, name, en - b, count * es);
            break;
        }
        t->data = f->map + data_off + (size_t)b;
        t->nbytes = nbytes;
        ranges[nr++] = (range){(size_t)b, (size_t)en, f->n - 1};
    }
    if (st == KVC_OK && nr > 1) {
        qsort(ranges, (size_t)nr, sizeof(range), range_cmp);
        for (int64_t i = 1; i < nr && st == KVC_OK; i++)
            if (ranges[i].begin < ranges[i - 1].end)
                st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': tensors '%s' and '%s' overlap" HINT, f->path,
                              f->tensors[ranges[i - 1].idx].name, f->tensors[ranges[i].idx].name);
    }
    free(ranges);
    return st;
}

kvc_status st_open(const char *path, st_file **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kvc_fail(KVC_ERR_IO, "'%s' is not a regular file", path);
    }
    if (sb.st_size < 10) {
        close(fd);
        return kvc_fail(KVC_ERR_FORMAT, "safetensors '%s' is too small (%lld bytes)" HINT, path, (long long)sb.st_size);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return kvc_fail(KVC_ERR_IO, "cannot map '%s': %s", path, strerror(errno));
    st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        munmap(map, (size_t)sb.st_size);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory");
    }
    f->map = map;
    f->size = (size_t)sb.st_size;
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    kvc_status st = KVC_OK;
    if (hlen < 2 || hlen > MAX_HEADER || hlen > f->size - 8)
        st = kvc_fail(KVC_ERR_FORMAT, "safetensors '%s': header length %llu does not fit the %zu-byte file" HINT, path,
                      (unsigned long long)hlen, f->size);
    json_value *hdr = NULL;
    if (st == KVC_OK) st = json_parse((const char *)f->map + 8, (size_t)hlen, path, &hdr);
    if (st == KVC_OK) st = parse_header(f, hdr, 8 + (size_t)hlen);
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
    if (f->map) munmap(f->map, f->size);
    free(f->path);
    free(f);
}

int64_t st_n_tensors(const st_file *f) { return f->n; }
const st_tensor *st_tensor_at(const st_file *f, int64_t i) { return &f->tensors[i]; }

const st_tensor *st_find(const st_file *f, const char *name) {
    for (int64_t i = 0; i < f->n; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

kvc_status st_to_f32(const st_tensor *t, float *dst) {
    const uint8_t *s = t->data;
    switch (t->dtype) {
    case ST_F32:
        memcpy(dst, s, (size_t)t->n_elements * 4);
        return KVC_OK;
    case ST_F16:
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < t->n_elements; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kvc_f16_to_f32(h);
        }
        return KVC_OK;
    case ST_BF16:
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < t->n_elements; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kvc_bf16_to_f32(h);
        }
        return KVC_OK;
    default:
        return kvc_fail(KVC_ERR_UNSUPPORTED, "tensor '%s' has dtype %s; only F32, F16 and BF16 weights are supported",
                        t->name, t->dtype_name);
    }
}
