"""Presses written in Python run inside the engine (kvpress_c/presses/python_press.py, csrc/press/scorers/
callback.c): Python re-implementations of Knorm, KeyDiff, TOVA, SnapKV and ExpectedAttention (python_presses.py,
float64 NumPy from docs/METHODS.md) keep the rows of the C presses, alone and under AdaKVPress, ChunkKVPress,
DecodingPress (alone and over AdaKV: heads of different lengths) and TAKE, on the CPU and the emulated device;
where the kept sets differ, the rows that differ must tie."""
import numpy as np
import pytest

import kvpress_c as K
from press_runs import rotations
from python_presses import PRESSES
from random_llama import write_random_llama

C_PRESSES = {"knorm": lambda **kw: K.KnormPress(**kw), "keydiff": lambda **kw: K.KeyDiffPress(**kw),
             "tova": lambda **kw: K.TOVAPress(**kw),
             "snapkv": lambda **kw: K.SnapKVPress(window_size=16, **kw),
             "expected_attention": lambda **kw: K.ExpectedAttentionPress(**kw)}
N = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("pypress")), layers=3, hidden=256, heads=4, kv_heads=2,
                              vocab=512, seed=7)


@pytest.fixture(scope="module", params=["cpu", "emulated"])
def model(request, model_dir):
    return K.load_model(model_dir, device=request.param)


@pytest.fixture(scope="module")
def ids():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("prompt seed", seed)
    return np.random.default_rng(seed).integers(3, 512, size=N).astype(np.int32)


def wrap(kind, make, ratio):
    keep = int(N * (1 - ratio))
    if kind == "alone":
        return make(compression_ratio=ratio)
    if kind == "adakv":
        return K.AdaKVPress(make(compression_ratio=ratio))
    if kind == "chunkkv":
        return K.ChunkKVPress(make(compression_ratio=ratio), chunk_length=8)
    if kind == "decoding":
        return K.DecodingPress(make(), compression_interval=20, target_size=max(keep, 24), hidden_states_buffer_size=32)
    if kind == "decoding_adakv":  # Ada-KV's uneven heads: the view pads them (layer.lengths)
        return K.DecodingPress(K.AdaKVPress(make()), compression_interval=20, target_size=max(keep, 24),
                               hidden_states_buffer_size=32)
    if kind == "take":
        return K.TAKEPress(budget=keep, chunk_size=64, press=make())
    raise AssertionError(kind)


def kept(model, press, ids, n_decode=45):
    """Kept positions [layer][kv head] after the prefill (and, for a decoding press, greedy steps)."""
    s = model.new_session()
    cfg = model.config
    if press.decoding_config() is not None:
        s.set_decoding_press(**press.decoding_config())
        logits = s.forward(ids, logits="last")
        for _ in range(n_decode):
            logits = s.forward(np.array([int(np.argmax(logits))], np.int32))
    else:
        if press.attach_to_session:
            s.set_press(**press.c_config())
        press.prefill(s, ids, cfg, question_ids=ids[-12:])
    return [[s.cache_positions(l, h) for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]


def inner(press):
    while not hasattr(press, "recorded"):
        press = getattr(press, "base_press", None) or press.press
    return press


@pytest.mark.parametrize("kind", ["alone", "adakv", "chunkkv", "decoding", "decoding_adakv", "take"])
@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_python_press_keeps_the_c_press_rows(model, ids, name, ratio, kind):
    ragged = kind == "decoding_adakv" and name != "tova"  # TOVA's scores are the layer's: Ada-KV keeps its heads even
    # a prompt whose Ada-KV split leaves every head of every layer the same length exercises no ragged heads
    # (ExpectedAttention at 0.9: 4 of 640 seeds); then the same prompt rotated, a different one
    for prompt in rotations(ids):
        ours = wrap(kind, PRESSES[name], ratio)
        theirs = wrap(kind, C_PRESSES[name], ratio)
        got, want = kept(model, ours, prompt), kept(model, theirs, prompt)
        recorded = inner(ours).recorded
        assert recorded, "the Python press was never called"
        if not ragged or any(len(set(lens.tolist())) > 1 for lens, _ in recorded.values()):
            break
    if ragged:  # the last compression scored heads of different lengths (the previous one's Ada-KV split), padded
        assert any(len(set(lens.tolist())) > 1 for lens, _ in recorded.values())
    for l, (gl, wl) in enumerate(zip(got, want)):
        for h, (g, w) in enumerate(zip(gl, wl)):
            if np.array_equal(g, w):
                continue
            # the sets differ: only where the prefill's rows are its positions can the scores say they tie
            assert kind not in ("decoding", "decoding_adakv", "take"), (l, h, np.setxor1d(g, w))
            lens, s = recorded[l]
            a, b = np.setdiff1d(g, w), np.setdiff1d(w, g)
            assert len(a) == len(b), (l, h, a, b)
            scale = np.abs(s[h, :lens[h]]).max()
            # float32 scores in C, float64 here: a tie is within a few float32 ulps of the scale
            assert np.abs(s[h, a].min() - s[h, b].max()) <= 1e-6 * scale, (l, h, s[h, a], s[h, b])


@pytest.mark.parametrize("kind", ["composed", "block", "chunk_press", "pyramid"])
def test_python_press_under_other_wrappers(model, ids, kind):
    """ComposedPress (a Python press after a C one and the other way round), BlockPress, ChunkPress and a
    PyramidKV allocation over a Python scorer keep what the same C presses keep."""
    from python_presses import PyKnorm, PySnapKV
    if kind == "composed":
        ours = K.ComposedPress([PySnapKV(compression_ratio=0.3), K.KnormPress(compression_ratio=0.3), PyKnorm(compression_ratio=0.2)])
        theirs = K.ComposedPress([K.SnapKVPress(compression_ratio=0.3, window_size=16), K.KnormPress(compression_ratio=0.3),
                                  K.KnormPress(compression_ratio=0.2)])
    elif kind == "block":
        ours, theirs = (K.BlockPress(p(compression_ratio=0.6), block_size=32) for p in (PyKnorm, K.KnormPress))
    elif kind == "chunk_press":
        ours, theirs = (K.ChunkPress(p(compression_ratio=0.6), chunk_length=40) for p in (PyKnorm, K.KnormPress))
    else:  # PyramidKV's layer budgets over the window scorer: the allocation is the config's
        ours, theirs = PySnapKV(compression_ratio=0.6), K.SnapKVPress(compression_ratio=0.6, window_size=16)
    got, want = run_with(model, ours, ids, pyramid=kind == "pyramid"), run_with(model, theirs, ids, pyramid=kind == "pyramid")
    assert got == want


def run_with(model, press, ids, pyramid=False):
    s = model.new_session()
    cfg = press.c_config()
    if pyramid:
        cfg.update(allocation="pyramid")
    s.set_press(**cfg)
    press.prefill(s, ids, model.config)
    return [[s.cache_positions(l, h).tolist() for h in range(2)] for l in range(3)]


def test_run_many_shares_the_prefill_with_python_presses(default_model):
    """run_many's shared prefill: Python presses among C ones, each compressing its own copy, keep what they keep
    in their own runs (and the Python Knorm what the C Knorm keeps)."""
    from kvpress_c.demo import needle_prompt
    from python_presses import PyKnorm, PySnapKV
    context, question, _ = needle_prompt(default_model, n_tokens=250)
    pipe = K.Pipeline(default_model)
    presses = [PyKnorm(compression_ratio=0.5), K.KnormPress(compression_ratio=0.5), PySnapKV(compression_ratio=0.5),
               K.AdaKVPress(PySnapKV(compression_ratio=0.5))]
    many = pipe.run_many(context, question, presses=presses, max_new_tokens=4)
    for press, res in zip(presses, many):
        alone = pipe(context, question, press=press, max_new_tokens=4)
        assert alone.answers == res.answers
        for a, b in zip(alone.kept_indices, res.kept_indices):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    for a, b in zip(many[0].kept_indices, many[1].kept_indices):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
