/* The K/V storage types' names and checks (the formats are kv_type.h's). */
#include "kv_type.h"
#include "common.h"

static const char *const names[KVC_KV_N_TYPES] = {"f32", "bf16", "f16", "q8_0", "kivi4", "kivi2"};

const char *kvc_kv_type_name(int32_t type) { return type >= 0 && type < KVC_KV_N_TYPES ? names[type] : NULL; }

kvc_status kvc_kv_format_check(const kvc_kv_format *f, int32_t d) {
    if (!f) return kvc_fail(KVC_ERR_ARG, "K/V cache type: format is NULL");
    if (f->type == KVC_KV_NATIVE) return KVC_OK;
    if (!kvc_kv_type_name(f->type))
        return kvc_fail(KVC_ERR_ARG, "K/V cache type %d is not one of f32, bf16, f16, q8_0, kivi4 (4 bits), kivi2 (2 bits)",
                        f->type);
    if (!kvc_kv_type_key_blocks(f->type)) return KVC_OK;
    const int32_t bits = kvc_kv_type_bits(f->type), per = 8 / bits, g = kvc_kivi_vgroup(f->group, d);
    if (f->group < 1 || f->group > 4096)
        return kvc_fail(KVC_ERR_ARG, "QuantizedCache: q_group_size must be in [1, 4096], got %d", f->group);
    if (f->residual < 0 || f->residual > (1 << 20))
        return kvc_fail(KVC_ERR_ARG, "QuantizedCache: residual_length must be in [0, 1048576], got %d", f->residual);
    if (d % g != 0 || g % per != 0)
        return kvc_fail(KVC_ERR_ARG,
                        "QuantizedCache: values are quantised in groups of min(q_group_size, head_dim) = %d channels, "
                        "which must divide head_dim %d and be a multiple of %d (%d-bit codes fill whole bytes): "
                        "choose q_group_size among the divisors of %d",
                        g, d, per, bits, d);
    if (d % per != 0)
        return kvc_fail(KVC_ERR_ARG, "QuantizedCache: %d-bit key rows need head_dim %d to be a multiple of %d", bits, d, per);
    return KVC_OK;
}
