/* The CPU backend's kernel table: the readable reference the CUDA backend is tested against. */
#include "../backend.h"
#include "cpu.h"

static const kvc_backend cpu_backend = {
    .name = "cpu",
    .matmul = kvc_cpu_matmul,
    .rmsnorm = kvc_cpu_rmsnorm,
    .rope = kvc_cpu_rope,
    .swiglu = kvc_cpu_swiglu,
    .add_bias = kvc_cpu_add_bias,
    .add = kvc_cpu_add,
    .attention = kvc_cpu_attention,
};

const kvc_backend *kvc_cpu_backend(void) { return &cpu_backend; }
