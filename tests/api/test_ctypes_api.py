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


def test_ctypes_callback_scorer(default_gguf):
    """A C client's own scorer (kvc_scorer_callback, set by name as "callback"): here -||k|| computed in the
    callback from the view's keys keeps the rows the built-in Knorm keeps; a failing callback fails the forward
    with its message, and the session goes on once reset."""
    from capi import SCORER_CALLBACK, check
    m = C.c_void_p()
    check(lib.kvc_model_load(default_gguf.encode(), C.byref(m)))
    seen = []

    def knorm(user, view):
        v = view.contents
        hkv, n, d = v.n_kv_heads, v.max_len, v.head_dim
        keys = np.ctypeslib.as_array(v.keys, shape=(hkv, n, d))
        lens = np.ctypeslib.as_array(v.len, shape=(hkv,))
        scores = np.ctypeslib.as_array(v.scores, shape=(hkv, n))
        scores[:] = -np.linalg.norm(keys.astype(np.float64), axis=-1)
        seen.append((v.layer, user, lens.tolist(), v.values is None or not bool(v.values)))
        return 0

    def failing(user, view):
        msg = b"no scores today"
        C.memmove(view.contents.message, msg, len(msg) + 1)
        return 1

    ids = np.random.default_rng(3).integers(3, 49152, size=64).astype(np.int32)
    logits = np.zeros(49152, dtype=np.float32)

    def kept(scorer, fn=None):
        spec = PressSpec(scorer=scorer, compression_ratio=0.5)
        if fn is not None:
            spec.callback = C.cast(fn, C.c_void_p).value
            spec.callback_user = 42
        s = C.c_void_p()
        check(lib.kvc_session_new(m, 0, C.byref(s)))
        check(lib.kvc_session_attach_press(s, spec._p))
        st = lib.kvc_forward(s, ids, len(ids), 1, logits)
        out = []
        if st == 0:
            for l in range(30):
                for h in range(3):
                    pos = np.zeros(64, np.int64)
                    check(lib.kvc_session_cache_positions(s, l, h, pos))
                    out.append(pos[:lib.kvc_session_cache_len(s, l, h)].copy())
        return st, out, s

    cb = SCORER_CALLBACK(knorm)
    st, ours, s1 = kept("callback", cb)
    assert st == 0, lib.kvc_last_error()
    st, ref, s2 = kept("knorm")
    assert st == 0
    assert all(np.array_equal(a, b) for a, b in zip(ours, ref))
    assert [x[0] for x in seen] == list(range(30)) and {x[1] for x in seen} == {42}
    assert all(x[2] == [64, 64, 64] and x[3] for x in seen)  # no values asked for: none given
    # no function: refused at attach
    spec = PressSpec(scorer="callback", compression_ratio=0.5)
    assert lib.kvc_press_spec_check(spec._p) == 1 and b"callback" in lib.kvc_last_error()
    bad = SCORER_CALLBACK(failing)
    st, _, s3 = kept("callback", bad)
    assert st == 1 and b"layer 0" in lib.kvc_last_error() and b"no scores today" in lib.kvc_last_error()
    assert lib.kvc_session_cache_len(s3, 0, 0) == 0  # rolled back
    check(lib.kvc_session_attach_press(s3, None))
    assert lib.kvc_forward(s3, ids, len(ids), 1, logits) == 0  # nothing was evicted at layer 0: it goes on
    for s in (s1, s2, s3):
        lib.kvc_session_free(s)
    lib.kvc_model_free(m)


def test_ctypes_callback_rows_in_place(default_gguf):
    """KVC_VIEW_IN_PLACE on the CPU: no host copy (keys, values NULL), each head's f32 rows lent where the store keeps
    them, equal to the copies a callback without the flag reads; a retained view's rows stay readable after the
    forward compacted the store (kvc_scorer_view_retain), until released; the kept rows are Knorm's either way."""
    from capi import ROWS_F32, SCORER_CALLBACK, VIEW_IN_PLACE, VIEW_VALUES, check
    m = C.c_void_p()
    check(lib.kvc_model_load(default_gguf.encode(), C.byref(m)))
    ids = np.random.default_rng(5).integers(3, 49152, size=48).astype(np.int32)
    logits = np.zeros(49152, dtype=np.float32)
    seen, handles = {}, []

    def score(view, keys, values):
        v = view.contents
        scores = np.ctypeslib.as_array(v.scores, shape=(v.n_kv_heads, v.max_len))
        scores[:] = -np.linalg.norm(keys.astype(np.float64), axis=-1)

    def copied(user, view):
        v = view.contents
        shape = (v.n_kv_heads, v.max_len, v.head_dim)
        keys, values = (np.ctypeslib.as_array(p, shape=shape).copy() for p in (v.keys, v.values))
        assert not v.key_rows and not v.value_rows
        seen[("copied", v.layer)] = (keys, values)
        score(view, keys, values)
        return 0

    def lent(user, view):
        v = view.contents
        assert not v.keys and not v.values and v.rows_dtype == ROWS_F32 and v.rows_host == 1
        rows = [[np.ctypeslib.as_array(C.cast(t[h], C.POINTER(C.c_float)), shape=(v.len[h], v.head_dim))
                 for h in range(v.n_kv_heads)] for t in (v.key_rows, v.value_rows)]
        keys, values = (np.stack(r) for r in rows)
        if v.layer % 2 == 0:  # keep these past the call
            handle = lib.kvc_scorer_view_retain(view)
            assert handle, lib.kvc_last_error()
            handles.append((handle, rows, keys.copy(), values.copy()))
        seen[("lent", v.layer)] = (keys.copy(), values.copy())
        score(view, keys, values)
        return 0

    def run(fn, needs):
        spec = PressSpec(scorer="callback", compression_ratio=0.5, callback_needs=needs)
        spec.callback = C.cast(fn, C.c_void_p).value
        s = C.c_void_p()
        check(lib.kvc_session_new(m, 0, C.byref(s)))
        check(lib.kvc_session_attach_press(s, spec._p))
        check(lib.kvc_forward(s, ids, len(ids), 1, logits))
        out = []
        for l in range(30):
            for h in range(3):
                pos = np.zeros(48, np.int64)
                check(lib.kvc_session_cache_positions(s, l, h, pos))
                out.append(pos[:lib.kvc_session_cache_len(s, l, h)].copy())
        lib.kvc_session_free(s)
        return out

    cb_copied, cb_lent = SCORER_CALLBACK(copied), SCORER_CALLBACK(lent)
    want = run(cb_copied, VIEW_VALUES)
    got = run(cb_lent, VIEW_VALUES | VIEW_IN_PLACE)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    for l in range(30):
        for a, b in zip(seen[("lent", l)], seen[("copied", l)]):
            np.testing.assert_array_equal(a, b)
    junk = [np.full(1 << 16, 7.0, np.float32) for _ in range(64)]  # noqa: F841 (memory handed out again)
    assert len(handles) == 15
    for handle, rows, keys, values in handles:
        for h in range(3):
            np.testing.assert_array_equal(rows[0][h], keys[h])
            np.testing.assert_array_equal(rows[1][h], values[h])
        lib.kvc_scorer_view_release(handle)
    lib.kvc_model_free(m)


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
