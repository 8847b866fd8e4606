/* GGUF v2/v3 reader: the whole file is memory-mapped, the header, metadata and tensor infos are
 * parsed with bounds and overflow checks, and tensors are returned as pointers into the mapping. */
#ifndef KVC_GGUF_H
#define KVC_GGUF_H

#include "../core/common.h"

/* GGUF metadata value types */
enum gguf_type {
    GGUF_T_U8 = 0, GGUF_T_I8 = 1, GGUF_T_U16 = 2, GGUF_T_I16 = 3, GGUF_T_U32 = 4, GGUF_T_I32 = 5,
    GGUF_T_F32 = 6, GGUF_T_BOOL = 7, GGUF_T_STRING = 8, GGUF_T_ARRAY = 9, GGUF_T_U64 = 10,
    GGUF_T_I64 = 11, GGUF_T_F64 = 12
};

/* ggml tensor types (the ones we decode; dequant.c knows the sizes and names of the others) */
enum ggml_type {
    GGML_T_F32 = 0, GGML_T_F16 = 1, GGML_T_Q4_0 = 2, GGML_T_Q4_1 = 3, GGML_T_Q5_0 = 6, GGML_T_Q5_1 = 7,
    GGML_T_Q8_0 = 8, GGML_T_Q2_K = 10, GGML_T_Q3_K = 11, GGML_T_Q4_K = 12, GGML_T_Q5_K = 13, GGML_T_Q6_K = 14,
    GGML_T_BF16 = 30
};

typedef struct gguf_tensor {
    const char *name;     /* NUL-terminated copy */
    int32_t type;         /* ggml_type */
    int32_t n_dims;
    int64_t ne[4];        /* ne[0] is the contiguous (row) dimension, as in ggml */
    int64_t n_elements;
    const void *data;     /* into the mapping, bounds-checked; NULL for a ggml type unknown to dequant.c */
    size_t nbytes;
} gguf_tensor;

typedef struct gguf_file gguf_file;

kvc_status gguf_open(const char *path, gguf_file **out);
void gguf_close(gguf_file *f);
uint32_t gguf_version(const gguf_file *f);

/* metadata */
int64_t gguf_n_kv(const gguf_file *f);
int64_t gguf_find_kv(const gguf_file *f, const char *key); /* -1 if absent */
const char *gguf_kv_key(const gguf_file *f, int64_t i);
/* type of the value; for arrays *is_array = 1, type = element type, *n = element count */
int32_t gguf_kv_type(const gguf_file *f, int64_t i, int32_t *is_array, uint64_t *n);
/* element j as a number (bool and integer and float types); KVC_ERR_FORMAT/ARG on mismatch */
kvc_status gguf_kv_number(const gguf_file *f, int64_t i, uint64_t j, double *out);
/* element j as a string (not NUL-terminated) */
kvc_status gguf_kv_string(const gguf_file *f, int64_t i, uint64_t j, const char **s, uint64_t *len);

/* convenience: typed scalar lookups by key, with KVC_ERR_FORMAT naming the key when missing or of
 * the wrong type (the *_opt forms leave *out untouched and return KVC_OK when the key is absent) */
kvc_status gguf_get_int(const gguf_file *f, const char *key, int64_t *out);
kvc_status gguf_get_int_opt(const gguf_file *f, const char *key, int64_t *out);
kvc_status gguf_get_float_opt(const gguf_file *f, const char *key, double *out);
/* a single string (not NUL-terminated); *s and *len untouched when the key is absent */
kvc_status gguf_get_string_opt(const gguf_file *f, const char *key, const char **s, uint64_t *len);

/* tensors */
int64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i); /* NULL if out of range */
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL if absent */

#endif
