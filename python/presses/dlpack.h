/* The DLPack exchange structs (the DLPack 1.0 C ABI: https://dmlc.github.io/dlpack/latest/c_api.html), written out
 * here so the module needs no header beyond Python's and NumPy's. A DLPack consumer (torch.from_dlpack,
 * numpy.from_dlpack) takes a PyCapsule named "dltensor" holding a DLManagedTensor, or "dltensor_versioned" holding a
 * DLManagedTensorVersioned, renames it "used_..." and calls the deleter when it lets the memory go. */
#ifndef KVC_PY_DLPACK_H
#define KVC_PY_DLPACK_H

#include <stdint.h>

enum { KVC_DL_CPU = 1, KVC_DL_CUDA = 2 };                 /* DLDeviceType */
enum { KVC_DL_FLOAT = 2, KVC_DL_BFLOAT = 4 };             /* DLDataTypeCode */
#define KVC_DL_FLAG_READ_ONLY ((uint64_t)1 << 0)          /* DLPACK_FLAG_BITMASK_READ_ONLY */

typedef struct {
    int32_t device_type;
    int32_t device_id;
} kvc_dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} kvc_dl_dtype;

typedef struct {
    void *data;
    kvc_dl_device device;
    int32_t ndim;
    kvc_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* in elements */
    uint64_t byte_offset;
} kvc_dl_tensor;

typedef struct kvc_dl_managed {
    kvc_dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct kvc_dl_managed *self);
} kvc_dl_managed;

typedef struct {
    uint32_t major;
    uint32_t minor;
} kvc_dl_version;

typedef struct kvc_dl_managed_versioned {
    kvc_dl_version version;
    void *manager_ctx;
    void (*deleter)(struct kvc_dl_managed_versioned *self);
    uint64_t flags;
    kvc_dl_tensor dl_tensor;
} kvc_dl_managed_versioned;

#endif
