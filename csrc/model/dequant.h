/* ggml block formats -> fp32. */
#ifndef KVC_DEQUANT_H
#define KVC_DEQUANT_H

#include "../core/common.h"

/* Elements per block and bytes per block of a ggml type; 0 for unknown types. */
int64_t ggml_block_elems(int32_t type);
size_t ggml_block_bytes(int32_t type);
const char *ggml_type_name(int32_t type); /* "unknown" for unknown types */
/* 1 if the type id is a ggml type we know the block size of / can dequantise. */
int ggml_type_known(int32_t type);
int ggml_type_supported(int32_t type);
/* Bytes needed for n elements of a known type (n must be a multiple of the block size):
 * KVC_ERR_FORMAT otherwise, KVC_ERR_UNSUPPORTED for unknown types. */
kvc_status ggml_nbytes(int32_t type, int64_t n, size_t *out);
/* Dequantise n elements; src_bytes must equal ggml_nbytes(type, n). KVC_ERR_UNSUPPORTED for types
 * that are known but not decoded (IQ*, TQ*, ...). */
kvc_status ggml_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst, int64_t n);

#endif
