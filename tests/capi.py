"""ctypes view of the public C ABI (csrc/include/kvpress_c.h) for tests that call kernels and press
functions on plain arrays, without the Python module."""
from __future__ import annotations

import ctypes as C

import numpy as np

from kvpress_c._paths import core_library_path

lib = C.CDLL(core_library_path())
lib.kvc_last_error.restype = C.c_char_p

F32P = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
I64P = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")


class PressConfig(C.Structure):
    _fields_ = [("scorer", C.c_int32), ("allocation", C.c_int32), ("compression_ratio", C.c_double),
                ("budget", C.c_int64), ("window", C.c_int32), ("kernel", C.c_int32), ("pool_max", C.c_int32),
                ("gqa_max", C.c_int32), ("pool_then_reduce", C.c_int32), ("n_sink", C.c_int32),
                ("seed", C.c_uint64), ("alpha_safeguard", C.c_float), ("safeguard", C.c_int32),
                ("pyramid_beta", C.c_int32), ("record_scores", C.c_int32), ("chunk_length", C.c_int32),
                ("reuse_layers", C.c_int32), ("edie_alpha", C.c_float), ("drop_window", C.c_int32)]


lib.kvc_press_config_defaults.argtypes = [C.POINTER(PressConfig)]
lib.kvc_press_config_defaults.restype = None
lib.kvc_press_compute_ex.argtypes = [C.POINTER(PressConfig), C.c_int32, C.c_int32, C.c_int32, C.c_int32, C.c_int32,
                                     F32P, C.c_void_p, C.c_int64, F32P, F32P, C.c_int64, C.c_int64, F32P, I64P, I64P]
lib.kvc_press_compute_ex.restype = C.c_int


class CError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}: {lib.kvc_last_error().decode()}")
        self.status = status


def check(status):
    """Raise CError for a failing status of a C call."""
    if status != 0:
        raise CError(status)


def press_config(**kw) -> PressConfig:
    cfg = PressConfig()
    lib.kvc_press_config_defaults(C.byref(cfg))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def press_compute(cfg: PressConfig, q, k, v, layer=0, n_layers=1, attn=None, layer_total=-1):
    """q [n, H, d], k/v [Hkv, len, d] -> scores [Hkv, len], kept rows per head (list of arrays)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    n, H, d = q.shape
    Hkv, length, _ = k.shape
    scores = np.zeros((Hkv, length), dtype=np.float32)
    keep = np.zeros((Hkv, length), dtype=np.int64)
    n_keep = np.zeros(Hkv, dtype=np.int64)
    a = None if attn is None else np.ascontiguousarray(attn, dtype=np.float32)
    st = lib.kvc_press_compute_ex(C.byref(cfg), H, Hkv, d, layer, n_layers, q,
                                  None if a is None else a.ctypes.data, n, k, v, length, layer_total,
                                  scores, keep, n_keep)
    if st != 0:
        raise CError(st)
    return scores, [keep[h, :n_keep[h]].copy() for h in range(Hkv)]
