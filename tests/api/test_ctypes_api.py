"""The public C ABI driven through ctypes alone: load, configure, forward, press, errors."""
import ctypes as C

import numpy as np

from capi import ARRAY_F64, ARRAY_I64, PressArrayDesc, PressSpec, lib


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


def test_ctypes_press_arrays_by_name(default_gguf, rng):
    """A wrapper's arrays through the header alone: BlockPress's block_size and PerLayerCompressionPress's
    layer_ratios set by name with their sizes, checked against the model; introspection lists every array."""
    arrays = {}
    for i in range(lib.kvc_press_array_count()):
        d = PressArrayDesc()
        assert lib.kvc_press_array_info(i, C.byref(d)) == 0
        arrays[d.name.decode()] = (d.press.decode(), d.type, d.shape.decode())
    assert arrays["block_size"] == ("BlockPress", ARRAY_I64, "one")
    assert arrays["layer_ratios"] == ("PerLayerCompressionPress", ARRAY_F64, "layers")
    assert lib.kvc_press_array_info(len(arrays), C.byref(PressArrayDesc())) == 1
    m = C.c_void_p()
    assert lib.kvc_model_load(default_gguf.encode(), C.byref(m)) == 0, lib.kvc_last_error()
    s = C.c_void_p()
    assert lib.kvc_session_new(m, 0, C.byref(s)) == 0
    spec = C.c_void_p()
    assert lib.kvc_press_spec_new(b"knorm", C.byref(spec)) == 0
    assert lib.kvc_press_spec_set_f64(spec, b"compression_ratio", 0.5) == 0
    assert lib.kvc_session_attach_press(s, spec) == 0
    one = C.c_int64(16)
    assert lib.kvc_session_set_press_array(s, b"block_size", ARRAY_I64, C.byref(one), 1) == 0
    bad = C.c_int64(0)
    assert lib.kvc_session_set_press_array(s, b"block_size", ARRAY_I64, C.byref(bad), 1) == 1
    assert b">= 1" in lib.kvc_last_error()
    two = np.array([0.5, 0.5])
    assert lib.kvc_session_set_press_array(s, b"layer_ratios", ARRAY_F64, two.ctypes.data, 2) == 1
    assert b"[30 layers]" in lib.kvc_last_error()
    assert lib.kvc_session_set_press_array(s, b"layer_ratios", ARRAY_I64, two.ctypes.data, 30) == 1
    assert b"float64" in lib.kvc_last_error()
    assert lib.kvc_session_set_press_array(s, b"no_such_array", ARRAY_I64, C.byref(one), 1) == 1
    assert b"no_such_array" in lib.kvc_last_error()
    # QFilter chooses the rows as BlockPress does: one part that selects per press
    filters = np.zeros(30 * 3 * 64, np.float32)
    assert lib.kvc_session_set_press_array(s, b"key_filters", 0, filters.ctypes.data, filters.size) == 1
    assert b"BlockPress and QFilterPress" in lib.kvc_last_error()
    ids = rng.integers(0, 49152, size=64).astype(np.int32)
    logits = np.zeros(49152, dtype=np.float32)
    assert lib.kvc_forward(s, ids, 64, 1, logits) == 0
    assert lib.kvc_session_cache_len(s, 3, 1) == 32
    # key re-rotation acts on a press alone: no chain after it
    on = C.c_int64(1)
    assert lib.kvc_session_set_press_array(s, b"key_rerotation", ARRAY_I64, C.byref(on), 1) == 0
    assert lib.kvc_session_chain_press(s, spec) == 1 and b"alone" in lib.kvc_last_error()
    lib.kvc_press_spec_free(spec)
    # a whole-cache method's array carries its size: KVzip's scores [L, Hkv, n] of a full 64-row cache
    full = C.c_void_p()
    assert lib.kvc_session_new(m, 0, C.byref(full)) == 0
    assert lib.kvc_forward(full, ids, 64, 1, logits) == 0
    scores = rng.random(30 * 3 * 64).astype(np.float32)
    assert lib.kvc_session_kvzip_evict(full, scores, scores.size - 1, 0.5, 0, 4) == 1
    assert b"the array holds 5759 values, the call needs 5760" in lib.kvc_last_error()
    assert lib.kvc_session_kvzip_evict(full, scores, scores.size, 0.5, 0, 4) == 0
    assert sum(lib.kvc_session_cache_len(full, l, h) for l in range(30) for h in range(3)) == 30 * 3 * 64 // 2
    lib.kvc_session_free(full)
    lib.kvc_session_free(s)
    lib.kvc_model_free(m)
