/* safetensors reader: memory-mapped, JSON header validated (dtype, shape, offsets inside the data
 * section, no overlap, sizes that match shape x dtype). */
#ifndef KVC_SAFETENSORS_H
#define KVC_SAFETENSORS_H

#include "../core/common.h"

typedef enum st_dtype { ST_F32, ST_F16, ST_BF16, ST_OTHER } st_dtype;

typedef struct st_tensor {
    char *name;
    st_dtype dtype;
    char dtype_name[8];
    int32_t n_dims;
    int64_t shape[8];
    int64_t n_elements;
    const void *data;   /* into the mapping */
    size_t nbytes;
} st_tensor;

typedef struct st_file st_file;

kvc_status st_open(const char *path, st_file **out);
void st_close(st_file *f);
int64_t st_n_tensors(const st_file *f);
const st_tensor *st_tensor_at(const st_file *f, int64_t i);
const st_tensor *st_find(const st_file *f, const char *name);
/* The string of `key` in the header's __metadata__, or NULL. */
const char *st_meta(const st_file *f, const char *key);
/* The metadata entries in header order: key i (NULL past the end), its value in *value. */
size_t st_meta_count(const st_file *f);
const char *st_meta_at(const st_file *f, size_t i, const char **value);
/* The whole file as mapped (size bytes) and where its data section starts (8 + the header's length). */
const uint8_t *st_bytes(const st_file *f, size_t *size, size_t *data_off);
/* Convert a tensor to fp32 into dst (n_elements floats); KVC_ERR_UNSUPPORTED for other dtypes. */
kvc_status st_to_f32(const st_tensor *t, float *dst);
/* The same for elements [first, first + n). */
kvc_status st_range_to_f32(const st_tensor *t, int64_t first, int64_t n, float *dst);

#endif
