/* GGUF v2/v3 reader. The file is memory-mapped read-only; every count, length and offset read from
 * it is checked against the bytes that remain before it is used, so a truncated, bit-flipped or
 * lying file yields KVC_ERR_FORMAT with a message, never a huge allocation or an out-of-bounds read. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dequant.h"
#include "gguf.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define HINT "; the file may be truncated or corrupt: re-download or re-convert it"

typedef struct gguf_kv {
    char *key;
    int32_t type;      /* element type for arrays */
    int32_t is_array;
    uint64_t n;
    const uint8_t *data; /* first element */
    const uint8_t **items; /* string arrays: pointer to each element (lazy, built at parse) */
} gguf_kv;

struct gguf_file {
    uint8_t *map;
    size_t size;
    uint32_t version;
    gguf_kv *kv;
    int64_t n_kv;
    gguf_tensor *tensors;
    int64_t n_tensors;
};

typedef struct reader {
    const uint8_t *p, *end, *base;
} reader;

static size_t scalar_size(int32_t t) {
    switch (t) {
    case GGUF_T_U8: case GGUF_T_I8: case GGUF_T_BOOL: return 1;
    case GGUF_T_U16: case GGUF_T_I16: return 2;
    case GGUF_T_U32: case GGUF_T_I32: case GGUF_T_F32: return 4;
    case GGUF_T_U64: case GGUF_T_I64: case GGUF_T_F64: return 8;
    default: return 0;
    }
}

static kvc_status need(reader *r, size_t n, const char *what) {
    if ((size_t)(r->end - r->p) < n)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s at byte %zu runs past the end of the file (%zu bytes)" HINT, what,
                        (size_t)(r->p - r->base), (size_t)(r->end - r->base));
    return KVC_OK;
}

static kvc_status rd_u32(reader *r, uint32_t *v, const char *what) {
    KVC_TRY(need(r, 4, what));
    memcpy(v, r->p, 4);
    r->p += 4;
    return KVC_OK;
}

static kvc_status rd_u64(reader *r, uint64_t *v, const char *what) {
    KVC_TRY(need(r, 8, what));
    memcpy(v, r->p, 8);
    r->p += 8;
    return KVC_OK;
}

/* A GGUF string: u64 length + bytes. Returns a pointer to the length field. */
static kvc_status rd_str(reader *r, const uint8_t **start, uint64_t *len, const char *what) {
    *start = r->p;
    KVC_TRY(rd_u64(r, len, what));
    if (*len > (uint64_t)(r->end - r->p))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s at byte %zu claims %llu bytes, more than the file holds" HINT, what,
                        (size_t)(*start - r->base), (unsigned long long)*len);
    r->p += *len;
    return KVC_OK;
}

static kvc_status parse_kv(gguf_file *f, reader *r, gguf_kv *kv, int64_t index) {
    const uint8_t *s;
    uint64_t len;
    KVC_TRY(rd_str(r, &s, &len, "metadata key"));
    if (len == 0 || len > 65535)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata key %lld has length %llu" HINT, (long long)index, (unsigned long long)len);
    kv->key = malloc(len + 1);
    if (!kv->key) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF metadata");
    memcpy(kv->key, s + 8, len);
    kv->key[len] = '\0';
    if (strlen(kv->key) != len) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata key %lld contains a NUL byte" HINT, (long long)index);
    uint32_t type;
    KVC_TRY(rd_u32(r, &type, "metadata value type"));
    if (type == GGUF_T_ARRAY) {
        uint32_t et;
        uint64_t n;
        KVC_TRY(rd_u32(r, &et, "array element type"));
        KVC_TRY(rd_u64(r, &n, "array length"));
        if (et == GGUF_T_ARRAY)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: metadata '%s' is an array of arrays, which is not supported", kv->key);
        kv->type = (int32_t)et;
        kv->is_array = 1;
        kv->n = n;
        kv->data = r->p;
        if (et == GGUF_T_STRING) {
            /* every string needs at least its 8-byte length: bound n before allocating */
            if (n > (uint64_t)(r->end - r->p) / 8)
                return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' claims %llu strings, more than the file holds" HINT,
                                kv->key, (unsigned long long)n);
            kv->items = malloc(sizeof(*kv->items) * (size_t)(n ? n : 1));
            if (!kv->items) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF metadata '%s'", kv->key);
            for (uint64_t j = 0; j < n; j++) {
                uint64_t l;
                KVC_TRY(rd_str(r, &kv->items[j], &l, kv->key));
            }
        } else {
            const size_t es = scalar_size((int32_t)et);
            if (!es) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' has unknown element type %u" HINT, kv->key, et);
            if (n > (uint64_t)(r->end - r->p) / es)
                return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' claims %llu elements, more than the file holds" HINT,
                                kv->key, (unsigned long long)n);
            r->p += n * es;
        }
    } else if (type == GGUF_T_STRING) {
        kv->type = GGUF_T_STRING;
        kv->n = 1;
        kv->items = malloc(sizeof(*kv->items));
        if (!kv->items) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF metadata");
        uint64_t l;
        KVC_TRY(rd_str(r, &kv->items[0], &l, kv->key));
        kv->data = kv->items[0];
    } else {
        const size_t es = scalar_size((int32_t)type);
        if (!es) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' has unknown value type %u" HINT, kv->key, type);
        KVC_TRY(need(r, es, kv->key));
        kv->type = (int32_t)type;
        kv->n = 1;
        kv->data = r->p;
        r->p += es;
    }
    (void)f;
    return KVC_OK;
}

static kvc_status parse(gguf_file *f) {
    reader r = {f->map, f->map + f->size, f->map};
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    KVC_TRY(rd_u32(&r, &magic, "magic"));
    if (magic != GGUF_MAGIC) return kvc_fail(KVC_ERR_FORMAT, "not a GGUF file (bad magic): give a .gguf file or a Hugging Face folder");
    KVC_TRY(rd_u32(&r, &f->version, "version"));
    if (f->version == 1) return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF v1 is not supported: re-convert the model with a current llama.cpp");
    if (f->version != 2 && f->version != 3)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: unknown version %u (supported: 2, 3)" HINT, f->version);
    KVC_TRY(rd_u64(&r, &n_tensors, "tensor count"));
    KVC_TRY(rd_u64(&r, &n_kv, "metadata count"));
    /* each kv needs >= 12 bytes and each tensor info >= 24: bound the counts by the file size */
    if (n_kv > f->size / 12 || n_tensors > f->size / 24)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: the header claims %llu metadata entries and %llu tensors, impossible for a %zu-byte file" HINT,
                        (unsigned long long)n_kv, (unsigned long long)n_tensors, f->size);
    f->kv = calloc((size_t)(n_kv ? n_kv : 1), sizeof(gguf_kv));
    f->tensors = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof(gguf_tensor));
    if (!f->kv || !f->tensors) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF header");
    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = (int64_t)i + 1;
        KVC_TRY(parse_kv(f, &r, &f->kv[i], (int64_t)i));
        for (uint64_t j = 0; j < i; j++)
            if (strcmp(f->kv[j].key, f->kv[i].key) == 0) return kvc_fail(KVC_ERR_FORMAT, "GGUF: duplicate metadata key '%s'" HINT, f->kv[i].key);
    }
    uint64_t alignment = 32;
    int64_t ai = gguf_find_kv(f, "general.alignment");
    if (ai >= 0) {
        double a;
        KVC_TRY(gguf_kv_number(f, ai, 0, &a));
        if (f->kv[ai].is_array || a < 1 || a > 65536 || ((uint64_t)a & ((uint64_t)a - 1)))
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: general.alignment must be a power of two, got %g" HINT, a);
        alignment = (uint64_t)a;
    }
    uint64_t *offsets = malloc(sizeof(uint64_t) * (size_t)(n_tensors ? n_tensors : 1));
    if (!offsets) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF tensor table");
    kvc_status st = KVC_OK;
    for (uint64_t i = 0; i < n_tensors && st == KVC_OK; i++) {
        gguf_tensor *t = &f->tensors[i];
        f->n_tensors = (int64_t)i + 1;
        const uint8_t *s;
        uint64_t len;
        uint32_t nd, type;
        if ((st = rd_str(&r, &s, &len, "tensor name")) != KVC_OK) break;
        if (len == 0 || len > 4096) { st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor %llu has a name of length %llu" HINT, (unsigned long long)i, (unsigned long long)len); break; }
        char *name = malloc(len + 1);
        if (!name) { st = kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF tensor names"); break; }
        memcpy(name, s + 8, len);
        name[len] = '\0';
        t->name = name;
        if ((st = rd_u32(&r, &nd, t->name)) != KVC_OK) break;
        if (nd < 1 || nd > 4) { st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has %u dimensions (1 to 4 allowed)" HINT, t->name, nd); break; }
        t->n_dims = (int32_t)nd;
        int64_t count = 1;
        for (int k = 0; k < 4; k++) t->ne[k] = 1;
        for (uint32_t k = 0; k < nd && st == KVC_OK; k++) {
            uint64_t ne;
            if ((st = rd_u64(&r, &ne, t->name)) != KVC_OK) break;
            if (ne > (uint64_t)INT64_MAX / 2 || (ne && (uint64_t)count > (uint64_t)INT64_MAX / ne)) {
                st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has an impossible shape" HINT, t->name);
                break;
            }
            t->ne[k] = (int64_t)ne;
            count *= (int64_t)ne;
        }
        if (st != KVC_OK) break;
        t->n_elements = count;
        if ((st = rd_u32(&r, &type, t->name)) != KVC_OK) break;
        t->type = (int32_t)type;
        if ((st = rd_u64(&r, &offsets[i], t->name)) != KVC_OK) break;
        for (uint64_t j = 0; j < i; j++)
            if (strcmp(f->tensors[j].name, t->name) == 0) { st = kvc_fail(KVC_ERR_FORMAT, "GGUF: duplicate tensor '%s'" HINT, t->name); break; }
    }
    if (st == KVC_OK) {
        size_t data_start = (size_t)(r.p - f->map);
        data_start = (data_start + alignment - 1) / alignment * alignment;
        if (data_start > f->size && n_tensors > 0)
            st = kvc_fail(KVC_ERR_FORMAT, "GGUF: the tensor data section starts past the end of the file" HINT);
        for (uint64_t i = 0; i < n_tensors && st == KVC_OK; i++) {
            gguf_tensor *t = &f->tensors[i];
            if (offsets[i] % alignment) {
                st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' data offset %llu is not aligned to %llu" HINT, t->name,
                              (unsigned long long)offsets[i], (unsigned long long)alignment);
                break;
            }
            size_t nbytes = 0;
            kvc_status ns = ggml_nbytes(t->type, t->n_elements, &nbytes);
            if (ns == KVC_ERR_UNSUPPORTED) {
                /* a type we cannot decode: fine unless the model needs this tensor (checked by the loader) */
                t->nbytes = 0;
                t->data = NULL;
                continue;
            }
            if (ns != KVC_OK || (t->ne[0] % ggml_block_elems(t->type)) != 0) {
                st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has %lld elements, not a whole number of %s blocks" HINT,
                              t->name, (long long)t->n_elements, ggml_type_name(t->type));
                break;
            }
            if (offsets[i] > f->size - data_start || nbytes > f->size - data_start - offsets[i]) {
                st = kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' (%zu bytes at offset %llu) lies outside the file" HINT, t->name,
                              nbytes, (unsigned long long)offsets[i]);
                break;
            }
            t->data = f->map + data_start + offsets[i];
            t->nbytes = nbytes;
        }
    }
    free(offsets);
    return st;
}

kvc_status gguf_open(const char *path, gguf_file **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvc_fail(KVC_ERR_IO, "'%s' is not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return kvc_fail(KVC_ERR_FORMAT, "'%s' is too small (%lld bytes) to be a GGUF file" HINT, path, (long long)st.st_size);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return kvc_fail(KVC_ERR_IO, "cannot map '%s': %s", path, strerror(errno));
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        munmap(map, (size_t)st.st_size);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF file");
    }
    f->map = map;
    f->size = (size_t)st.st_size;
    kvc_status s = parse(f);
    if (s != KVC_OK) {
        gguf_close(f);
        return s;
    }
    *out = f;
    return KVC_OK;
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n_kv; i++) {
        free(f->kv[i].key);
        free(f->kv[i].items);
    }
    free(f->kv);
    for (int64_t i = 0; i < f->n_tensors; i++) free((char *)f->tensors[i].name);
    free(f->tensors);
    if (f->map) munmap(f->map, f->size);
    free(f);
}

uint32_t gguf_version(const gguf_file *f) { return f->version; }
int64_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }

int64_t gguf_find_kv(const gguf_file *f, const char *key) {
    for (int64_t i = 0; i < f->n_kv; i++)
        if (f->kv[i].key && strcmp(f->kv[i].key, key) == 0) return i;
    return -1;
}

const char *gguf_kv_key(const gguf_file *f, int64_t i) { return f->kv[i].key; }

int32_t gguf_kv_type(const gguf_file *f, int64_t i, int32_t *is_array, uint64_t *n) {
    *is_array = f->kv[i].is_array;
    *n = f->kv[i].n;
    return f->kv[i].type;
}

kvc_status gguf_kv_number(const gguf_file *f, int64_t i, uint64_t j, double *out) {
    const gguf_kv *kv = &f->kv[i];
    if (j >= kv->n) return kvc_fail(KVC_ERR_ARG, "GGUF: element %llu of '%s' out of range", (unsigned long long)j, kv->key);
    const size_t es = scalar_size(kv->type);
    if (!es) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is not a number", kv->key);
    const uint8_t *p = kv->data + j * es;
    switch (kv->type) {
    case GGUF_T_U8: *out = *p; break;
    case GGUF_T_I8: *out = (int8_t)*p; break;
    case GGUF_T_BOOL: *out = *p != 0; break;
    case GGUF_T_U16: { uint16_t v; memcpy(&v, p, 2); *out = v; break; }
    case GGUF_T_I16: { int16_t v; memcpy(&v, p, 2); *out = v; break; }
    case GGUF_T_U32: { uint32_t v; memcpy(&v, p, 4); *out = v; break; }
    case GGUF_T_I32: { int32_t v; memcpy(&v, p, 4); *out = v; break; }
    case GGUF_T_F32: { float v; memcpy(&v, p, 4); *out = v; break; }
    case GGUF_T_U64: { uint64_t v; memcpy(&v, p, 8); *out = (double)v; break; }
    case GGUF_T_I64: { int64_t v; memcpy(&v, p, 8); *out = (double)v; break; }
    case GGUF_T_F64: { double v; memcpy(&v, p, 8); *out = v; break; }
    default: return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is not a number", kv->key);
    }
    return KVC_OK;
}

kvc_status gguf_kv_string(const gguf_file *f, int64_t i, uint64_t j, const char **s, uint64_t *len) {
    const gguf_kv *kv = &f->kv[i];
    if (kv->type != GGUF_T_STRING) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is not a string", kv->key);
    if (j >= kv->n) return kvc_fail(KVC_ERR_ARG, "GGUF: element %llu of '%s' out of range", (unsigned long long)j, kv->key);
    memcpy(len, kv->items[j], 8);
    *s = (const char *)kv->items[j] + 8;
    return KVC_OK;
}

static kvc_status get_number(const gguf_file *f, const char *key, double *out, int required) {
    int64_t i = gguf_find_kv(f, key);
    if (i < 0) return required ? kvc_fail(KVC_ERR_FORMAT, "GGUF: required metadata '%s' is missing" HINT, key) : KVC_OK;
    if (f->kv[i].is_array || f->kv[i].n != 1) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' should be a single number" HINT, key);
    return gguf_kv_number(f, i, 0, out);
}

kvc_status gguf_get_int(const gguf_file *f, const char *key, int64_t *out) {
    double v;
    KVC_TRY(get_number(f, key, &v, 1));
    if (v != (double)(int64_t)v) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' = %g is not an integer" HINT, key, v);
    *out = (int64_t)v;
    return KVC_OK;
}

kvc_status gguf_get_int_opt(const gguf_file *f, const char *key, int64_t *out) {
    if (gguf_find_kv(f, key) < 0) return KVC_OK;
    return gguf_get_int(f, key, out);
}

kvc_status gguf_get_float_opt(const gguf_file *f, const char *key, double *out) {
    return get_number(f, key, out, 0);
}

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) { return &f->tensors[i]; }

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].name && strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}
