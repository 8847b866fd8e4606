"""The public C ABI driven through ctypes alone: load, configure, forward, press, errors."""
import ctypes as C

import numpy as np

from capi import PressSpec, lib


def test_ctypes_forward_matches_module(default_gguf, default_model, rng):
    m = C.c_void_p()
    # fp32 weights (KVC_WEIGHTS_FP32 = 1), as the module's reference model: last-token logits of native
    # weights go through the integer GEMV (tests/model/test_native_weights.py)
    assert lib.kvc_model_load_ex(default_gguf.encode(), 0, 1, C.byref(m)) == 0, lib.kvc_last_error()
    n_native = C.c_int32(-1)
    assert lib.kvc_model_weights(m, C.byref(n_native)) == 1 and n_native.value == 0
    s = C.c_void_p()
    assert lib.kvc_session_new(m, 0, C.byref(s)) == 0
    ids = rng.integers(0, 49152, size=40).astype(np.int32)
    logits = np.zeros(49152, dtype=np.float32)
    assert lib.kvc_forward(s, ids, 40, 1, logits) == 0
    ref = default_model.logits(ids)[-1]
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert lib.kvc_session_cache_len(s, 0, 0) == 40
    # a press by name: Knorm keeping 10 per head on the next prefill
    spec = C.c_void_p()
    assert lib.kvc_press_spec_new(b"knorm", C.byref(spec)) == 0
    assert lib.kvc_press_spec_set_i64(spec, b"budget", 10) == 0 and lib.kvc_press_spec_set_i64(spec, b"window", 0) == 0
    assert lib.kvc_press_spec_set_i64(spec, b"no_such_setting", 1) == 1
    assert b"no_such_setting" in lib.kvc_last_error()
    assert lib.kvc_press_spec_set_str(spec, b"scorer", b"knrm") == 1 and b"knorm" in lib.kvc_last_error()
    s2 = C.c_void_p()
    assert lib.kvc_session_new(m, 0, C.byref(s2)) == 0
    assert lib.kvc_session_attach_press(s2, spec) == 0
    lib.kvc_press_spec_free(spec)
    assert lib.kvc_forward(s2, ids, 40, 1, logits) == 0
    assert lib.kvc_session_cache_len(s2, 5, 1) == 10
    assert lib.kvc_session_cache_bytes(s2) < lib.kvc_session_cache_bytes(s)
    # errors come back as a status and a message, the session survives
    bad = np.array([60000], dtype=np.int32)
    assert lib.kvc_forward(s, bad, 1, 1, logits) == 1
    assert b"vocabulary" in lib.kvc_last_error()
    assert lib.kvc_forward(s, ids[:1], 1, 1, logits) == 0
    lib.kvc_session_free(s)
    lib.kvc_session_free(s2)
    lib.kvc_model_free(m)
    assert lib.kvc_version() == b"0.1.0"


def test_ctypes_errors_without_model():
    m = C.c_void_p()
    assert lib.kvc_model_load(b"/nonexistent/model.gguf", C.byref(m)) == 2
    assert b"does not exist" in lib.kvc_last_error()
    assert lib.kvc_model_load(b"", C.byref(m)) == 1
