"""The one ctypes view of the public C ABI (csrc/include/kvpress_c.h) for the tests: the library with every
signature the tests call, its structs (kvc_config, kvc_press_array_desc), status and device codes, and the
press functions on plain arrays. Tests that call the C core without the Python module import from here."""
from __future__ import annotations

import ctypes as C

import numpy as np

from kvpress_c import _core
from kvpress_c._paths import core_library_path

F32P = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
I64P = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
I32P = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")

# kvc_status
OK, ERR_ARG, ERR_IO, ERR_FORMAT, ERR_NOMEM, ERR_UNSUPPORTED, ERR_DEVICE, ERR_INTERNAL = range(8)
# kvc_device
DEVICES = {"cpu": 0, "cuda": 1, "emulated": 2}


def why_no_cuda() -> str:
    """Why the CUDA device cannot run here ("" when it can)."""
    import kvpress_c
    try:
        kvpress_c.device_info("cuda")
        return ""
    except RuntimeError as e:
        return str(e)
# kvc_scorer, kvc_allocation, kvc_safeguard: name -> code, read from the header by the module
SCORERS, ALLOCATIONS, SAFEGUARDS = dict(_core.SCORERS), dict(_core.ALLOCATIONS), dict(_core.SAFEGUARDS)


class Config(C.Structure):  # kvc_config
    _fields_ = [(n, C.c_int32) for n in ("arch", "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab",
                                         "max_context", "rope_pairing", "tied_embeddings", "qkv_bias")] + \
               [("rms_eps", C.c_float), ("rope_theta", C.c_float), ("rope_scaling_factor", C.c_float),
                ("rope_low_freq_factor", C.c_float), ("rope_high_freq_factor", C.c_float),
                ("rope_original_context", C.c_int32), ("bos_id", C.c_int32), ("eos_id", C.c_int32),
                ("qk_norm", C.c_int32), ("sliding_window", C.c_int32), ("window_first_layer", C.c_int32),
                ("rope_dim", C.c_int32), ("rope_long_context", C.c_int32), ("rope_attn_factor", C.c_float),
                ("window_period", C.c_int32), ("rope_local_theta", C.c_float), ("attn_scale", C.c_float),
                ("embed_scale", C.c_float), ("mlp_act", C.c_int32), ("post_norms", C.c_int32),
                ("attn_softcap", C.c_float), ("logit_softcap", C.c_float),
                ("n_experts", C.c_int32), ("n_experts_used", C.c_int32), ("moe_ffn", C.c_int32),
                ("moe_norm_topk", C.c_int32), ("moe_step", C.c_int32), ("moe_dense", C.c_uint32 * 8)]


class KVFormat(C.Structure):  # kvc_kv_format
    _fields_ = [("type", C.c_int32), ("group", C.c_int32), ("residual", C.c_int32)]


_V, _I, _I32, _I64, _SZ, _F, _D = C.c_void_p, C.c_int, C.c_int32, C.c_int64, C.c_size_t, C.c_float, C.c_double


class KVFormat(C.Structure):  # kvc_kv_format: a K/V store's type
    _fields_ = [("type", C.c_int32), ("group", C.c_int32), ("residual", C.c_int32)]
SIGNATURES = {  # name: (restype, argtypes)
    "kvc_last_error": (C.c_char_p, []),
    "kvc_version": (C.c_char_p, []),
    "kvc_set_blas": (_I, [C.c_char_p, C.c_char_p]),
    "kvc_blas_name": (C.c_char_p, []),
    "kvc_set_num_threads": (None, [_I]),
    "kvc_get_num_threads": (_I, []),
    "kvc_model_load": (_I, [C.c_char_p, C.POINTER(_V)]),
    "kvc_model_load_device": (_I, [C.c_char_p, _I32, C.POINTER(_V)]),
    "kvc_model_free": (None, [_V]),
    "kvc_model_get_config": (_I, [_V, C.POINTER(Config)]),
    "kvc_model_weight_bytes": (_SZ, [_V]),
    "kvc_model_mapped_bytes": (_SZ, [_V]),
    "kvc_model_format": (C.c_char_p, [_V]),
    "kvc_session_new": (_I, [_V, _I64, C.POINTER(_V)]),
    "kvc_session_free": (None, [_V]),
    "kvc_forward": (_I, [_V, I32P, _I64, _I32, F32P]),
    "kvc_session_cache_len": (_I64, [_V, _I32, _I32]),
    "kvc_session_cache_bytes": (_SZ, [_V]),
    # presses by name (kvc_press_spec): no struct mirrored here
    "kvc_press_spec_new": (_I, [C.c_char_p, C.POINTER(_V)]),
    "kvc_press_spec_free": (None, [_V]),
    "kvc_press_spec_set_i64": (_I, [_V, C.c_char_p, _I64]),
    "kvc_press_spec_set_u64": (_I, [_V, C.c_char_p, C.c_uint64]),
    "kvc_press_spec_set_f64": (_I, [_V, C.c_char_p, _D]),
    "kvc_press_spec_set_str": (_I, [_V, C.c_char_p, C.c_char_p]),
    "kvc_press_spec_get": (_I, [_V, C.c_char_p, C.POINTER(_D)]),
    "kvc_press_spec_check": (_I, [_V]),
    "kvc_session_attach_press": (_I, [_V, _V]),
    "kvc_press_spec_compute": (_I, [_I32, _V, _I32, _I32, _I32, _I32, _I32, F32P, _I64, _V, _I64, _I64, F32P, F32P, _I64,
                                    _I64, _I64, F32P, _I64, I64P, _I64, I64P]),
    "kvc_press_param_count": (_I32, []),
    "kvc_session_set_press_array": (_I, [_V, C.c_char_p, _I32, _V, _I64]),
    "kvc_session_chain_press": (_I, [_V, _V]),
    "kvc_press_array_count": (_I32, []),
    "kvc_press_array_info": (_I, [_I32, _V]),
    "kvc_session_kvzip_evict": (_I, [_V, F32P, _I64, _D, _I32, _I32]),
    "kvc_kernel_matmul": (_I, [F32P, F32P, F32P, _I64, _I64, _I64]),
    "kvc_kernel_rmsnorm": (_I, [F32P, F32P, F32P, _I64, _I64, _F]),
    "kvc_kernel_rope": (_I, [F32P, I64P, _I64, _I32, _I32, F32P, _I32]),
    "kvc_kernel_rope_freqs": (_I, [C.POINTER(Config), F32P]),
    "kvc_kernel_swiglu": (_I, [F32P, F32P, F32P, _I64, _I64]),
    "kvc_kernel_attention": (_I, [F32P, _I64, _I32, _I32, _I32, _V, _V, I64P, _F, F32P]),
    "kvc_kernel_dequantize": (_I, [_I32, _V, _SZ, _V, _I64]),
    "kvc_model_load_ex": (_I, [C.c_char_p, _I32, _I32, C.POINTER(_V)]),
    "kvc_model_weights": (_I32, [_V, C.POINTER(_I32)]),
    "kvc_kernel_matmul_native": (_I, [_I32, F32P, _V, F32P, _I64, _I64, _I64, _I32]),
    "kvc_kernel_kv_decode": (_I, [C.POINTER(KVFormat), _I32, _V, _SZ, _I64, _I64, _I32, _I32, F32P, C.POINTER(_I32)]),
    "kvc_kernel_kv_encode": (_I, [C.POINTER(KVFormat), F32P, _I64, _I32, _I32, _V, _SZ]),
    "kvc_kernel_kv_tile": (_I, [C.POINTER(KVFormat), _V, _SZ, _I64, _V, _SZ, _I32, _I32, _I32, F32P, F32P, F32P, F32P,
                            C.POINTER(_I32)]),
    "kvc_device_available": (_I, [_I32]),
    "kvc_device_set_option": (_I, [_I32, C.c_char_p, _I32]),
    "kvc_device_kernel_matmul": (_I, [_I32, F32P, F32P, F32P, _I64, _I64, _I64]),
    "kvc_device_kernel_rmsnorm": (_I, [_I32, F32P, _V, F32P, F32P, _V, _I64, _I64, _F]),
    "kvc_device_kernel_rope": (_I, [_I32, F32P, I64P, _I64, _I32, _I32, F32P, _I32]),
    "kvc_device_kernel_swiglu": (_I, [_I32, F32P, F32P, F32P, _I64, _I64]),
    "kvc_device_kernel_attention": (_I, [_I32, F32P, _I64, _I32, _I32, _I32, _V, _V, I64P, _V, _F, F32P, _I32]),
    "kvc_device_kernel_attention_softcap": (_I, [_I32, F32P, _I64, _I32, _I32, _I32, _V, _V, I64P, _V, _F, _F, F32P, _I32]),
    "kvc_device_kernel_attention_pruned": (_I, [_I32, F32P, _I64, _I32, _I32, _I32, _V, _V, I64P, I64P, _I32, I32P, _F,
                                               F32P, _I32]),
    "kvc_device_kernel_head_rmsnorm": (_I, [_I32, F32P, _I64, _I32, _I32, F32P, _F]),
    "kvc_device_kernel_topk": (_I, [_I32, F32P, _I32, _I64, I64P, I64P]),
    "kvc_device_kernel_kv_rows": (_I, [_I32, _I32, _I32, _I32, _I64, _I32, _I64, _I64]),
    "kvc_device_kernel_moe_route": (_I, [_I32, F32P, _I64, _I32, _I32, _I32, I32P, F32P]),
    "kvc_device_kernel_gather_rows": (_I, [_I32, F32P, _I64, I32P, _I64, _I64, F32P]),
    "kvc_device_kernel_moe_combine": (_I, [_I32, F32P, F32P, F32P, I32P, _I64, _I32, _I64]),
    "kvc_model_layer_moe": (_I32, [_V, _I32]),
    "kvc_device_kernel_kv_store": (_I, [_I32, C.POINTER(KVFormat), _I32, _I32, _I64, _I64, F32P, F32P, F32P, F32P,
                                        C.POINTER(_SZ)]),
    "kvc_tada_allocate": (_I, [C.POINTER(_D), _I32, _I64, _I64, _I64, C.POINTER(_I64)]),
    "kvc_merge_similar": (_I, [F32P, F32P, _I64, _I32, I64P, _I64, _F, _F, F32P]),
    "kvc_scorer_count": (_I32, []),
    "kvc_scorer_info": (_I, [_I32, C.POINTER(C.c_char_p), C.POINTER(_I32), C.POINTER(C.c_uint32),
                             C.POINTER(C.POINTER(C.c_char_p))]),
    "kvc_cam_merge": (_I, [F32P, F32P, F32P, _I32, _I64, _I32, _I64, _I64, _I32, C.c_uint64, _I32, _I64, I64P, F32P]),
    "kvc_session_cache_positions": (_I, [_V, _I32, _I32, I64P]),
    "kvc_scorer_view_retain": (_V, [_V]),
    "kvc_scorer_view_release": (None, [_V]),
}


class ScorerView(C.Structure):  # kvc_scorer_view: what a callback scorer receives (kvpress_c.h)
    _fields_ = [(n, C.c_int32) for n in ("layer", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "device")] + [
        ("len", C.POINTER(C.c_int64)), ("max_len", C.c_int64), ("keys", C.POINTER(C.c_float)),
        ("values", C.POINTER(C.c_float)), ("n_call", C.c_int64), ("positions", C.POINTER(C.c_int64)),
        ("window", C.c_int32), ("queries", C.POINTER(C.c_float)), ("hidden", C.POINTER(C.c_float)),
        ("attentions", C.POINTER(C.c_float)), ("scores", C.POINTER(C.c_float)), ("keep", C.POINTER(C.c_int64)),
        ("n_keep", C.POINTER(C.c_int64)), ("message", C.POINTER(C.c_char)), ("message_size", C.c_int32),
        ("rope_pairing", C.c_int32), ("rope_freq", C.POINTER(C.c_double)), ("future_from", C.c_int64),
        ("rope_attn_factor", C.c_double),
        ("key_rows", C.POINTER(C.c_void_p)), ("value_rows", C.POINTER(C.c_void_p)), ("rows_dtype", C.c_int32),
        ("rows_host", C.c_int32), ("engine", C.c_void_p)]


# kvc_scorer_callback, KVC_VIEW_* bits, KVC_ROWS_*
VIEW_VALUES, VIEW_IN_PLACE = 1, 32
ROWS_F32, ROWS_BF16 = 0, 1
SCORER_CALLBACK = C.CFUNCTYPE(C.c_int32, C.c_void_p, C.POINTER(ScorerView))


class PressArrayDesc(C.Structure):  # kvc_press_array_desc
    _fields_ = [("name", C.c_char_p), ("press", C.c_char_p), ("type", C.c_int32), ("shape", C.c_char_p),
                ("doc", C.c_char_p)]


# KVC_ARRAY_*
ARRAY_F32, ARRAY_F64, ARRAY_I64 = range(3)


def bind(lib):
    """Declare every signature on a loaded libkvpress_c (the default one, or another build of it)."""
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


lib = bind(C.CDLL(core_library_path()))


class CError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}: {lib.kvc_last_error().decode()}")
        self.status = status


def check(status):
    """Raise CError for a failing status of a C call."""
    if status != 0:
        raise CError(status)


def last_error() -> str:
    return lib.kvc_last_error().decode(errors="replace")


class PressSpec:
    """A press's settings by name through the C ABI (kvc_press_spec): attributes read and set its settings."""

    def __init__(self, **settings):
        p = C.c_void_p()
        check(lib.kvc_press_spec_new(None, C.byref(p)))
        object.__setattr__(self, "_p", p)
        for k, v in settings.items():
            setattr(self, k, v)

    def __setattr__(self, name, value):
        key = name.encode()
        if isinstance(value, str):
            check(lib.kvc_press_spec_set_str(self._p, key, value.encode()))
        elif isinstance(value, float):
            check(lib.kvc_press_spec_set_f64(self._p, key, value))
        elif int(value) > 2**63 - 1:
            check(lib.kvc_press_spec_set_u64(self._p, key, int(value)))
        else:
            check(lib.kvc_press_spec_set_i64(self._p, key, int(value)))

    def __getattr__(self, name):
        out = C.c_double()
        check(lib.kvc_press_spec_get(self._p, name.encode(), C.byref(out)))
        return out.value

    def __del__(self):
        p = self.__dict__.get("_p")
        if p:
            lib.kvc_press_spec_free(p)


def press_config(**kw) -> PressSpec:
    return PressSpec(**kw)


def press_compute(cfg: PressSpec, q, k, v, layer=0, n_layers=1, attn=None, layer_total=-1, device="cpu"):
    """q [n, H, d], k/v [Hkv, len, d] -> scores [Hkv, len], kept rows per head (list of arrays), on a device."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    n, H, d = q.shape
    Hkv, length, _ = k.shape
    scores = np.zeros((Hkv, length), dtype=np.float32)
    keep = np.zeros((Hkv, length), dtype=np.int64)
    n_keep = np.zeros(Hkv, dtype=np.int64)
    a = None if attn is None else np.ascontiguousarray(attn, dtype=np.float32)
    check(lib.kvc_press_spec_compute(DEVICES[device], cfg._p, H, Hkv, d, layer, n_layers, q, q.size,
                                     None if a is None else a.ctypes.data, 0 if a is None else a.size, n, k, v, k.size,
                                     length, layer_total, scores, scores.size, keep, keep.size, n_keep))
    return scores, [keep[h, :n_keep[h]].copy() for h in range(Hkv)]


def merge_similar(k, v, keep, threshold=0.0, fraction=1.0):
    """kvc_merge_similar: one head's k, v [n, d] and kept rows -> the kept rows' merged values [n_keep, d]."""
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    keep = np.ascontiguousarray(keep, dtype=np.int64)
    out = np.zeros((len(keep), k.shape[1]), np.float32)
    check(lib.kvc_merge_similar(k, v, k.shape[0], k.shape[1], keep, len(keep), threshold, fraction, out))
    return out


def cam_merge(scores, attn, v, target, n_merge, merge_budget, seed=0, layer=0, event=0):
    """kvc_cam_merge: scores, attn [Hkv, n], v [Hkv, n, d] -> (keep [target], merged values [Hkv, target, d])."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    attn = np.ascontiguousarray(attn, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    Hkv, n, d = v.shape
    keep = np.zeros(target, np.int64)
    out = np.zeros((Hkv, target, d), np.float32)
    check(lib.kvc_cam_merge(scores, attn, v, Hkv, n, d, target, n_merge, merge_budget, seed, layer, event, keep, out))
    return keep, out


def kv_store(k, v, kv_type, group=0, residual=0, step=None, device="cpu"):
    """k, v [Hkv, n, d] through a K/V store of type kv_type (kvpress_c.kv_cache codes) filled `step` rows at a
    time (kvc_device_kernel_kv_store: write, hold, commit each); -> (keys, values read back in f32, kv_bytes)."""
    k, v = np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32)
    Hkv, n, d = k.shape
    ko, vo, nb = np.empty_like(k), np.empty_like(v), C.c_size_t(0)
    fmt = KVFormat(kv_type, group, residual)
    check(lib.kvc_device_kernel_kv_store(DEVICES[device], C.byref(fmt), Hkv, d, n, step or max(n, 1), k, v, ko, vo,
                                         C.byref(nb)))
    return ko, vo, nb.value


def step_int16(kv_type):
    """1 where this build's decode step on tiles of kv_type (a KVFormat type code: q8_0 3, kivi4 4, kivi2 5)
    multiplies int16 weights (AVX-512 VNNI: q8_0 and KIVI; AVX2: q8_0), 0 where floats, None where it decodes such tiles to fp32 instead
    (asked on a one-row tile of head_dim 64)."""
    import numpy as np
    fmt = KVFormat(kv_type, 64 if kv_type in (4, 5) else 0, 128 if kv_type in (4, 5) else 0)
    bits = {4: 4, 5: 2}.get(kv_type)
    if bits:  # a KIVI key block of 64 rows, one value row (scale, min, codes)
        block, vals = np.zeros(4 * 64 + 64 * 64 * bits // 8, np.uint8), np.zeros(4 + 64 * bits // 8, np.uint8)
    else:  # one row stored alone (q8_0: 2 blocks of 34 bytes)
        rb = 68 if kv_type == 3 else 128
        block, vals = np.zeros(rb, np.uint8), np.zeros(rb, np.uint8)
    q, s, p, o, flag = (np.zeros(64, np.float32), np.zeros(1, np.float32), np.zeros(1, np.float32),
                        np.zeros(64, np.float32), C.c_int32(-1))
    st = lib.kvc_kernel_kv_tile(C.byref(fmt), block.ctypes.data, block.nbytes, 0, vals.ctypes.data, vals.nbytes,
                                1, 64, 1, q, s, p, o, C.byref(flag))
    if st == ERR_UNSUPPORTED:
        return None
    if st != OK:
        raise RuntimeError(lib.kvc_last_error().decode())
    return flag.value

