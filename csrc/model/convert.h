/* Scalar conversions of 16-bit floats, shared by the GGUF and safetensors loaders. */
#ifndef KVC_CONVERT_H
#define KVC_CONVERT_H

#include <stdint.h>
#include <string.h>

#include "../core/half.h"

/* the loaders' names for the one conversion (core/half.h) */
static inline float kvc_f16_to_f32(uint16_t h) { return kvc_f16_to_f32v(h); }
static inline float kvc_bf16_to_f32(uint16_t b) { return kvc_bf16_to_f32r(b); }

#endif
