/* GGUF v2/v3 reader. The file is memory-mapped read-only; every count, length and offset read from
 * it is checked against the bytes that remain before it is used, so a truncated, bit-flipped or
 * lying file yields KVC_ERR_FORMAT with a message, never a huge allocation or an out-of-bounds read.
 * Layout: magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, n_kv x (string key, u32 type, value),
 * n_tensors x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml type, u64 offset), padding to
 * general.alignment, then the tensor data (offsets are relative to its start). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dequant.h"
#include "gguf.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define HINT "; the file may be truncated or corrupt: re-download or re-convert it"
/* smallest encodings: a kv is a key (8-byte length + >= 1 byte), a u32 type and >= 1 value byte;
 * a tensor info is a name (8 + >= 1), n_dims, one u64 dim, a u32 type and a u64 offset */
#define MIN_KV_BYTES 14u
#define MIN_TENSOR_BYTES 33u
/* ggml type ids are small; anything past this is a corrupt field rather than a newer type */
#define MAX_TYPE_ID 64

typedef struct gguf_kv {
    char *key;
    int32_t type;          /* element type for arrays */
    int32_t is_array;
    uint64_t n;            /* 1 for scalars */
    const uint8_t *data;   /* first element (numbers) */
    const uint8_t **items; /* strings: each element's length field */
} gguf_kv;

struct gguf_file {
    uint8_t *map;
    size_t size;
    uint32_t version;
    gguf_kv *kv;
    int64_t n_kv;          /* entries parsed so far (what gguf_close frees) */
    gguf_tensor *tensors;
    int64_t n_tensors;
    uint64_t alignment;
    size_t data_start;
};

typedef struct reader {
    const uint8_t *p, *end, *base;
} reader;

static size_t remaining(const reader *r) { return (size_t)(r->end - r->p); }
static size_t offset_of(const reader *r, const uint8_t *p) { return (size_t)(p - r->base); }

static size_t scalar_size(int32_t t) {
    switch (t) {
    case GGUF_T_U8: case GGUF_T_I8: case GGUF_T_BOOL: return 1;
    case GGUF_T_U16: case GGUF_T_I16: return 2;
    case GGUF_T_U32: case GGUF_T_I32: case GGUF_T_F32: return 4;
    case GGUF_T_U64: case GGUF_T_I64: case GGUF_T_F64: return 8;
    default: return 0;
    }
}

static kvc_status need(const reader *r, size_t n, const char *what, const char *name) {
    if (remaining(r) < n)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s%s%s%s at byte %zu runs past the end of the file (%zu bytes)" HINT, what,
                        name ? " of '" : "", name ? name : "", name ? "'" : "", offset_of(r, r->p),
                        (size_t)(r->end - r->base));
    return KVC_OK;
}

static kvc_status rd_u32(reader *r, uint32_t *v, const char *what, const char *name) {
    KVC_TRY(need(r, 4, what, name));
    memcpy(v, r->p, 4);
    r->p += 4;
    return KVC_OK;
}

static kvc_status rd_u64(reader *r, uint64_t *v, const char *what, const char *name) {
    KVC_TRY(need(r, 8, what, name));
    memcpy(v, r->p, 8);
    r->p += 8;
    return KVC_OK;
}

/* A GGUF string: u64 length + bytes. *start points at the length field. */
static kvc_status rd_str(reader *r, const uint8_t **start, uint64_t *len, const char *what, const char *name) {
    *start = r->p;
    KVC_TRY(rd_u64(r, len, what, name));
    if (*len > remaining(r))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s%s%s%s at byte %zu claims %llu bytes, but only %zu remain" HINT, what,
                        name ? " of '" : "", name ? name : "", name ? "'" : "", offset_of(r, *start),
                        (unsigned long long)*len, remaining(r));
    r->p += *len;
    return KVC_OK;
}

/* A name (key or tensor name) as a NUL-terminated copy; NUL bytes inside are rejected. */
static kvc_status rd_name(reader *r, const char *what, uint64_t index, uint64_t max_len, char **out) {
    const uint8_t *s;
    uint64_t len;
    KVC_TRY(rd_str(r, &s, &len, what, NULL));
    if (len == 0 || len > max_len)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s %llu at byte %zu has length %llu (1 to %llu allowed)" HINT, what,
                        (unsigned long long)index, offset_of(r, s), (unsigned long long)len, (unsigned long long)max_len);
    if (memchr(s + 8, 0, len))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: %s %llu at byte %zu contains a NUL byte" HINT, what,
                        (unsigned long long)index, offset_of(r, s));
    char *copy = malloc(len + 1);
    if (!copy) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF %s", what);
    memcpy(copy, s + 8, len);
    copy[len] = '\0';
    *out = copy;
    return KVC_OK;
}

static const char *value_type_name(uint32_t t) {
    static const char *names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Read the array's elements (or a string scalar) into kv. */
static kvc_status parse_values(reader *r, gguf_kv *kv, uint32_t et, uint64_t n) {
    kv->type = (int32_t)et;
    kv->n = n;
    kv->data = r->p;
    if (et == GGUF_T_STRING) {
        /* every string takes at least its 8-byte length: bound n before allocating */
        if (kv->is_array && n > remaining(r) / 8)
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' at byte %zu claims %llu strings, more than the %zu remaining bytes hold" HINT,
                            kv->key, offset_of(r, r->p), (unsigned long long)n, remaining(r));
        kv->items = malloc(sizeof(*kv->items) * (size_t)(n ? n : 1));
        if (!kv->items) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF metadata '%s' (%llu strings)", kv->key, (unsigned long long)n);
        for (uint64_t j = 0; j < n; j++) {
            uint64_t len;
            KVC_TRY(rd_str(r, &kv->items[j], &len, "string value", kv->key));
        }
        return KVC_OK;
    }
    const size_t es = scalar_size((int32_t)et);
    if (!es)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' at byte %zu has unknown value type %u" HINT, kv->key,
                        offset_of(r, r->p), et);
    if (!kv->is_array) KVC_TRY(need(r, es, "value", kv->key));
    if (n > remaining(r) / es)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' at byte %zu claims %llu %s values, more than the %zu remaining bytes hold" HINT,
                        kv->key, offset_of(r, r->p), (unsigned long long)n, value_type_name(et), remaining(r));
    r->p += n * es;
    return KVC_OK;
}

static kvc_status parse_kv(reader *r, gguf_kv *kv, uint64_t index) {
    KVC_TRY(rd_name(r, "metadata key", index, 65535, &kv->key));
    uint32_t type;
    const uint8_t *at = r->p;
    KVC_TRY(rd_u32(r, &type, "value type", kv->key));
    if (type != GGUF_T_ARRAY) {
        if (type != GGUF_T_STRING && !scalar_size((int32_t)type))
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' at byte %zu has unknown value type %u" HINT, kv->key,
                            offset_of(r, at), type);
        return parse_values(r, kv, type, 1);
    }
    uint32_t et;
    uint64_t n;
    KVC_TRY(rd_u32(r, &et, "array element type", kv->key));
    KVC_TRY(rd_u64(r, &n, "array length", kv->key));
    if (et == GGUF_T_ARRAY)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF: metadata '%s' is an array of arrays, which kvpress_c does not read", kv->key);
    kv->is_array = 1;
    return parse_values(r, kv, et, n);
}

/* Duplicate names: sort pointers to them and compare neighbours (n log n for any count). */
static int cmp_name(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static kvc_status check_unique(const char **names, int64_t n, const char *what) {
    if (n < 2) return KVC_OK;
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0) return kvc_fail(KVC_ERR_FORMAT, "GGUF: duplicate %s '%s'" HINT, what, names[i]);
    return KVC_OK;
}

static kvc_status unique_keys_and_names(gguf_file *f) {
    const int64_t n = f->n_kv > f->n_tensors ? f->n_kv : f->n_tensors;
    const char **names = malloc(sizeof(*names) * (size_t)(n ? n : 1));
    if (!names) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF name table");
    for (int64_t i = 0; i < f->n_kv; i++) names[i] = f->kv[i].key;
    kvc_status st = check_unique(names, f->n_kv, "metadata key");
    if (st == KVC_OK) {
        for (int64_t i = 0; i < f->n_tensors; i++) names[i] = f->tensors[i].name;
        st = check_unique(names, f->n_tensors, "tensor");
    }
    free(names);
    return st;
}

static kvc_status read_alignment(gguf_file *f) {
    f->alignment = 32;
    int64_t i = gguf_find_kv(f, "general.alignment");
    if (i < 0) return KVC_OK;
    const gguf_kv *kv = &f->kv[i];
    double a = 0;
    if (kv->is_array || kv->type == GGUF_T_F32 || kv->type == GGUF_T_F64 || kv->type == GGUF_T_BOOL ||
        gguf_kv_number(f, i, 0, &a) != KVC_OK)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: general.alignment must be an unsigned integer, found a %s%s" HINT,
                        kv->is_array ? "array of " : "", value_type_name((uint32_t)kv->type));
    if (!(a >= 1 && a <= 65536) || ((uint64_t)a & ((uint64_t)a - 1)))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: general.alignment must be a power of two up to 65536, found %.0f" HINT, a);
    f->alignment = (uint64_t)a;
    return KVC_OK;
}

static kvc_status parse_tensor_info(reader *r, gguf_tensor *t, uint64_t index, uint64_t *offset) {
    const uint8_t *at = r->p;
    KVC_TRY(rd_name(r, "tensor name", index, 4096, (char **)&t->name));
    uint32_t nd, type;
    KVC_TRY(rd_u32(r, &nd, "dimension count", t->name));
    if (nd < 1 || nd > 4)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' (info at byte %zu) has %u dimensions, 1 to 4 allowed" HINT, t->name,
                        offset_of(r, at), nd);
    t->n_dims = (int32_t)nd;
    for (int k = 0; k < 4; k++) t->ne[k] = 1;
    uint64_t count = 1;
    for (uint32_t k = 0; k < nd; k++) {
        uint64_t ne;
        KVC_TRY(rd_u64(r, &ne, "shape", t->name));
        /* each dimension and the product stay below 2^62, so sizes derived from them cannot overflow */
        if (ne >= (1ull << 62) || (ne && count > ((1ull << 62) - 1) / ne))
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' (info at byte %zu) has an impossible shape: dimension %u is %llu" HINT,
                            t->name, offset_of(r, at), k, (unsigned long long)ne);
        t->ne[k] = (int64_t)ne;
        count *= ne;
    }
    t->n_elements = (int64_t)count;
    KVC_TRY(rd_u32(r, &type, "type", t->name));
    if (type >= MAX_TYPE_ID)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' (info at byte %zu) has invalid ggml type id %u" HINT, t->name,
                        offset_of(r, at), type);
    t->type = (int32_t)type;
    return rd_u64(r, offset, "data offset", t->name);
}

/* Place every tensor of a known type inside the data section (aligned, whole blocks, in bounds). */
static kvc_status place_tensors(gguf_file *f, const uint64_t *offsets) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        if (offsets[i] % f->alignment)
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' data offset %llu is not a multiple of the alignment %llu" HINT,
                            t->name, (unsigned long long)offsets[i], (unsigned long long)f->alignment);
        if (!ggml_type_known(t->type)) {
            /* a type newer than this reader: no size to check; the loader refuses it if it needs it */
            t->data = NULL;
            t->nbytes = 0;
            continue;
        }
        const int64_t be = ggml_block_elems(t->type);
        if (t->ne[0] % be)
            return kvc_fail(KVC_ERR_FORMAT, "GGUF: tensor '%s' has rows of %lld values, not a whole number of %s blocks (%lld values)" HINT,
                            t->name, (long long)t->ne[0], ggml_type_name(t->type), (long long)be);
        size_t nbytes;
        KVC_TRY(ggml_nbytes(t->type, t->n_elements, &nbytes));
        const size_t avail = f->size - f->data_start;
        if (offsets[i] > avail || nbytes > avail - offsets[i])
            return kvc_fail(KVC_ERR_FORMAT,
                            "GGUF: tensor '%s' (%s, %zu bytes at data offset %llu, file byte %llu) ends past the end of the file (%zu bytes)" HINT,
                            t->name, ggml_type_name(t->type), nbytes, (unsigned long long)offsets[i],
                            (unsigned long long)(f->data_start + offsets[i]), f->size);
        t->data = f->map + f->data_start + offsets[i];
        t->nbytes = nbytes;
    }
    return KVC_OK;
}

static kvc_status parse(gguf_file *f) {
    reader r = {f->map, f->map + f->size, f->map};
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    KVC_TRY(rd_u32(&r, &magic, "magic", NULL));
    if (magic != GGUF_MAGIC)
        return kvc_fail(KVC_ERR_FORMAT, "not a GGUF file (the first 4 bytes are not \"GGUF\"): give a .gguf file or a Hugging Face folder");
    KVC_TRY(rd_u32(&r, &f->version, "version", NULL));
    if (f->version == 1)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "GGUF v1 files are not supported (v2 and v3 are): re-convert the model with a current llama.cpp");
    if (f->version == 0x02000000u || f->version == 0x03000000u)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "big-endian GGUF files are not supported: use a little-endian conversion");
    if (f->version != 2 && f->version != 3)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: unknown version %u at byte 4 (2 and 3 are supported)" HINT, f->version);
    KVC_TRY(rd_u64(&r, &n_tensors, "tensor count", NULL));
    KVC_TRY(rd_u64(&r, &n_kv, "metadata count", NULL));
    const size_t rest = remaining(&r);
    if (n_kv > rest / MIN_KV_BYTES || n_tensors > rest / MIN_TENSOR_BYTES ||
        n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_BYTES > rest)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: the header (bytes 8..23) claims %llu tensors and %llu metadata entries, more than the %zu-byte file can hold" HINT,
                        (unsigned long long)n_tensors, (unsigned long long)n_kv, f->size);
    f->kv = calloc((size_t)(n_kv ? n_kv : 1), sizeof(gguf_kv));
    f->tensors = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof(gguf_tensor));
    if (!f->kv || !f->tensors) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF header");
    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = (int64_t)i + 1; /* counted before parsing so that gguf_close frees a partial entry */
        KVC_TRY(parse_kv(&r, &f->kv[i], i));
    }
    uint64_t *offsets = malloc(sizeof(uint64_t) * (size_t)(n_tensors ? n_tensors : 1));
    if (!offsets) return kvc_fail(KVC_ERR_NOMEM, "out of memory: GGUF tensor table");
    kvc_status st = KVC_OK;
    for (uint64_t i = 0; i < n_tensors && st == KVC_OK; i++) {
        f->n_tensors = (int64_t)i + 1;
        st = parse_tensor_info(&r, &f->tensors[i], i, &offsets[i]);
    }
    if (st == KVC_OK) st = unique_keys_and_names(f);
    if (st == KVC_OK) st = read_alignment(f);
    if (st == KVC_OK) {
        const size_t info_end = offset_of(&r, r.p);
        f->data_start = (info_end + f->alignment - 1) / f->alignment * f->alignment;
        if (f->data_start > f->size) {
            if (n_tensors > 0)
                st = kvc_fail(KVC_ERR_FORMAT, "GGUF: the tensor data should start at byte %zu, past the end of the file (%zu bytes)" HINT,
                              f->data_start, f->size);
            f->data_start = f->size;
        }
    }
    if (st == KVC_OK) st = place_tensors(f, offsets);
    free(offsets);
    return st;
}

kvc_status gguf_open(const char *path, gguf_file **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "gguf_open: out is NULL");
    *out = NULL;
    if (!path) return kvc_fail(KVC_ERR_ARG, "gguf_open: path is NULL");
    /* non-blocking so that a FIFO or device given as a model fails below instead of hanging */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kvc_fail(KVC_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvc_fail(KVC_ERR_IO, "'%s' is not a regular file: give a .gguf file or a Hugging Face folder", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return kvc_fail(KVC_ERR_FORMAT, "'%s' has %lld bytes, too few for a GGUF header (24)" HINT, path, (long long)st.st_size);
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return kvc_fail(KVC_ERR_IO, "'%s' is too large to map on this platform", path);
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

const char *gguf_kv_key(const gguf_file *f, int64_t i) { return (i >= 0 && i < f->n_kv) ? f->kv[i].key : NULL; }

int32_t gguf_kv_type(const gguf_file *f, int64_t i, int32_t *is_array, uint64_t *n) {
    if (i < 0 || i >= f->n_kv) {
        *is_array = 0;
        *n = 0;
        return -1;
    }
    *is_array = f->kv[i].is_array;
    *n = f->kv[i].n;
    return f->kv[i].type;
}

static kvc_status kv_element(const gguf_file *f, int64_t i, uint64_t j, const gguf_kv **kv) {
    if (i < 0 || i >= f->n_kv) return kvc_fail(KVC_ERR_ARG, "GGUF: metadata index %lld out of range", (long long)i);
    *kv = &f->kv[i];
    if (j >= (*kv)->n)
        return kvc_fail(KVC_ERR_ARG, "GGUF: element %llu of '%s' out of range (%llu elements)", (unsigned long long)j,
                        (*kv)->key, (unsigned long long)(*kv)->n);
    return KVC_OK;
}

kvc_status gguf_kv_number(const gguf_file *f, int64_t i, uint64_t j, double *out) {
    const gguf_kv *kv = NULL;
    KVC_TRY(kv_element(f, i, j, &kv));
    const size_t es = scalar_size(kv->type);
    if (!es) return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is a %s, not a number" HINT, kv->key, value_type_name((uint32_t)kv->type));
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
    default: return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is not a number" HINT, kv->key);
    }
    return KVC_OK;
}

kvc_status gguf_kv_string(const gguf_file *f, int64_t i, uint64_t j, const char **s, uint64_t *len) {
    const gguf_kv *kv = NULL;
    KVC_TRY(kv_element(f, i, j, &kv));
    if (kv->type != GGUF_T_STRING)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' is a %s, not a string" HINT, kv->key, value_type_name((uint32_t)kv->type));
    memcpy(len, kv->items[j], 8);
    *s = (const char *)kv->items[j] + 8;
    return KVC_OK;
}

static kvc_status get_number(const gguf_file *f, const char *key, double *out, int required) {
    int64_t i = gguf_find_kv(f, key);
    if (i < 0) return required ? kvc_fail(KVC_ERR_FORMAT, "GGUF: required metadata '%s' is missing" HINT, key) : KVC_OK;
    if (f->kv[i].is_array)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' should be a single number, found an array of %llu" HINT, key,
                        (unsigned long long)f->kv[i].n);
    return gguf_kv_number(f, i, 0, out);
}

kvc_status gguf_get_int(const gguf_file *f, const char *key, int64_t *out) {
    double v;
    KVC_TRY(get_number(f, key, &v, 1));
    /* range first: converting an out-of-range double to an integer is undefined */
    if (!(v >= -9.2e18 && v <= 9.2e18) || v != floor(v))
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' = %g is not an integer" HINT, key, v);
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

kvc_status gguf_get_string_opt(const gguf_file *f, const char *key, const char **s, uint64_t *len) {
    int64_t i = gguf_find_kv(f, key);
    if (i < 0) return KVC_OK;
    if (f->kv[i].is_array || f->kv[i].type != GGUF_T_STRING)
        return kvc_fail(KVC_ERR_FORMAT, "GGUF: metadata '%s' should be a single string, found a %s%s" HINT, key,
                        f->kv[i].is_array ? "array of " : "", value_type_name((uint32_t)f->kv[i].type));
    return gguf_kv_string(f, i, 0, s, len);
}

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) {
    return (i >= 0 && i < f->n_tensors) ? &f->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].name && strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}
