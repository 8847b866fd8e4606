"""Presses written in Python: what their errors do (an exception in score() or compress() reaches the caller with
its traceback, the session as before the call and usable; bad scores or kept rows: ValueError naming the layer),
a selection written in Python (compress(): the engine evicts the rows it returns), and two threads running
Python presses on one model at once."""
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvpress_c as K
from kvpress_c import ScorerPress
from python_presses import PyKnorm
from random_llama import write_random_llama

N = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("pyerr")), layers=3, hidden=128, heads=4, kv_heads=2,
                              vocab=256, seed=3)


@pytest.fixture(scope="module", params=["cpu", "emulated"])
def model(request, model_dir):
    return K.load_model(model_dir, device=request.param)


@pytest.fixture
def ids():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("prompt seed", seed)
    return np.random.default_rng(seed).integers(3, 256, size=N).astype(np.int32)


class Boom(Exception):
    pass


@dataclass
class FailsAt(ScorerPress):
    at: int = 1
    make: object = None  # layer -> the scores to return (None: -||k||)

    def score(self, layer):
        if layer.index == self.at:
            if self.make is None:
                raise Boom(f"no scores for layer {layer.index}")
            return self.make(layer)
        return -np.linalg.norm(layer.keys, axis=-1)


def state(s, model):
    c = model.config
    return s.position, [[s.cache_positions(l, h).tolist() for h in range(c["n_kv_heads"])] for l in range(c["n_layers"])]


def run(model, press, ids):
    s = model.new_session()
    s.set_press(**press.c_config())
    s.forward(ids, logits="none")
    return s


def test_an_exception_reaches_the_caller_and_loses_nothing(model, ids):
    s = model.new_session()
    s.set_press(**FailsAt(compression_ratio=0.5, at=1).c_config())
    with pytest.raises(Boom, match="no scores for layer 1") as e:
        s.forward(ids, logits="last")
    frames = [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert "score" in frames, frames  # the traceback goes into the press's own code
    assert state(s, model) == (0, [[[]] * 2] * 3)  # as before the call
    # usable as it is: a good press on the same session gives what a fresh session gives
    s.set_press(**PyKnorm(compression_ratio=0.5).c_config())
    s.forward(ids, logits="none")
    assert state(s, model) == state(run(model, K.KnormPress(compression_ratio=0.5), ids), model)


def test_an_exception_after_a_prefix_keeps_the_prefix(model, ids):
    """A prompt after a cached prefix: the call's rows go, the prefix stays (nothing evicted at layer 0 yet)."""
    s = model.new_session()
    s.forward(ids[:40], logits="none")
    before = state(s, model)
    s.set_press(**FailsAt(compression_ratio=0.5, at=0).c_config())
    with pytest.raises(Boom):
        s.forward(ids[40:], logits="none")
    assert state(s, model) == before
    s.set_press(None)
    s.forward(ids[40:], logits="none")
    assert s.position == N


@pytest.mark.parametrize("bad, message", [
    (lambda l: np.zeros((l.n_kv_heads, l.n + 1)), r"layer 2: score\(\) returned scores of shape \(2, 97\)"),
    (lambda l: np.zeros((l.n_kv_heads, l.n), np.int64), "layer 2: score.. returned int64 scores, not float32 or float64"),
    (lambda l: np.where(np.arange(l.n) == 5, np.nan, 0.0)[None].repeat(2, 0), "layer 2, head 0: .* row 5 is NaN"),
    (lambda l: np.where(np.arange(l.n) == 7, np.inf, 0.0)[None].repeat(2, 0), "layer 2, head 0: .* row 7 is infinite"),
    (lambda l: "high", "layer 2: score.. returned <U4 scores, not float32 or float64"),
])
def test_bad_scores_name_the_layer(model, ids, bad, message):
    s = model.new_session()
    s.set_press(**FailsAt(compression_ratio=0.5, at=2, make=bad).c_config())
    with pytest.raises((ValueError, TypeError), match=message):
        s.forward(ids, logits="none")
    assert state(s, model) == (0, [[[]] * 2] * 3)
    s.set_press(None)
    s.forward(ids, logits="none")  # usable


@dataclass
class KeepGiven(ScorerPress):
    """A selection in Python: the rows of `rows(layer)` per head."""
    rows: object = None
    calls: list = field(default_factory=list)

    def compress(self, layer):
        self.calls.append(layer.index)
        return self.rows(layer)


def test_compress_evicts_the_rows_it_returns(model, ids):
    rng = np.random.default_rng(int(ids[0]))
    chosen = {}

    def rows(layer):
        out = [np.sort(rng.choice(layer.n, size=10 + 20 * h, replace=False))[::-1] for h in range(layer.n_kv_heads)]
        chosen[layer.index] = out
        return out  # any order: kept rows stay in position order

    press = KeepGiven(rows=rows)
    assert not press.is_noop
    full = model.new_session()
    full.forward(ids, logits="none")
    s = run(model, press, ids)
    assert press.calls == [0, 1, 2]
    for l in range(3):
        for h in range(2):
            np.testing.assert_array_equal(s.cache_positions(l, h), np.sort(chosen[l][h]))
    assert s.cache_bytes < full.cache_bytes
    logits = s.forward(ids[:1])  # decoding goes on over the ragged cache
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("rows, message", [
    (lambda l: [np.array([0, 1, l.n]), np.array([0])], r"layer 0, head 0: the callback scorer's kept row 96 is outside \[0, 96\)"),
    (lambda l: [np.array([0]), np.array([-1])], r"layer 0, head 1: .* kept row -1 is outside"),
    (lambda l: [np.array([3, 4, 3]), np.array([0])], "layer 0, head 0: .* kept row 3 is given twice"),
    (lambda l: [np.array([3])], "layer 0: compress.. returned 1 kept-row arrays for 2 KV heads"),
    (lambda l: [np.array([0.5]), np.array([1])], "layer 0, head 0: kept rows must be a 1-D array of integers"),
])
def test_bad_kept_rows_name_the_layer(model, ids, rows, message):
    s = model.new_session()
    s.set_press(**KeepGiven(rows=rows).c_config())
    with pytest.raises(ValueError, match=message):
        s.forward(ids, logits="none")
    assert state(s, model) == (0, [[[]] * 2] * 3)
    s.set_press(None)
    s.forward(ids, logits="none")  # usable


@dataclass
class ReadsValues(ScorerPress):
    def score(self, layer):
        return -np.linalg.norm(layer.values, axis=-1)


def test_undeclared_views_are_refused_by_name(model, ids):
    s = model.new_session()
    s.set_press(**ReadsValues(compression_ratio=0.5).c_config())
    with pytest.raises(AttributeError, match=r"ReadsValues reads layer.values: add 'values' to its `reads`"):
        s.forward(ids, logits="none")
    ReadsValues.reads = ("values",)
    try:
        s.set_press(**ReadsValues(compression_ratio=0.5).c_config())
        s.forward(ids, logits="none")
    finally:
        del ReadsValues.reads


def test_a_released_press_is_an_error_not_a_crash(model, ids):
    from kvpress_c.presses import python_press
    s = model.new_session()
    s.set_press(**PyKnorm(compression_ratio=0.5).c_config())  # nothing else holds the press: the registry does
    s.forward(ids, logits="none")
    press = PyKnorm(compression_ratio=0.5)
    s.reset()
    s.set_press(**press.c_config())
    python_press.release(press)
    with pytest.raises(ReferenceError, match="was released"):
        s.forward(ids, logits="none")


def test_two_threads_give_their_sequential_answers(model_dir, ids):
    """Two sessions of one model, each with its own Python press, forward at once (the GIL is released during
    compute and taken for the Python calls only): each keeps what it keeps alone."""
    model = K.load_model(model_dir)
    presses = [PyKnorm(compression_ratio=0.5), FailsAt(compression_ratio=0.7, at=-1)]
    prompts = [ids, ids[::-1].copy()]
    want = [state(run(model, p, x), model) for p, x in zip(presses, prompts)]
    sessions = [model.new_session() for _ in presses]
    for s, p in zip(sessions, presses):
        s.set_press(**p.c_config())
    got, errors = [None, None], []

    def work(i):
        try:
            for _ in range(5):
                sessions[i].reset()
                sessions[i].forward(prompts[i], logits="none")
            got[i] = state(sessions[i], model)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == want


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_two_pipelines_in_two_threads(device):
    """Two Pipelines on one model (the default one) in two threads, each with its Python press, answer as they do
    one after the other; on the emulated device (calls serialised under its lock) too: the bindings that take the
    device's lock (new sessions, set_press, reset, freeing) release the GIL a forward's Python press waits for."""
    from kvpress_c.demo import needle_prompt
    from python_presses import PySnapKV
    model = K.load_model(device=device)
    context, question, _ = needle_prompt(model, n_tokens=200)
    presses = [PyKnorm(compression_ratio=0.5), PySnapKV(compression_ratio=0.5)]
    want = [K.Pipeline(model)(context, question, press=p, max_new_tokens=6).answers for p in presses]
    got, errors = [None, None], []

    def work(i):
        try:
            for _ in range(2):
                got[i] = K.Pipeline(model)(context, question, press=presses[i], max_new_tokens=6).answers
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    assert got == want


@dataclass
class ReadsAll(ScorerPress):
    window_size: int = 8
    reads = ("values", "queries", "hidden_states", "attentions")
    seen: list = field(default_factory=list)

    def score(self, layer):
        self.seen.append({k: np.array(getattr(layer, k)) for k in ("keys", "values", "queries", "hidden_states",
                                                                    "attentions", "lengths", "positions")})
        return -np.linalg.norm(layer.keys, axis=-1)


def test_the_views_a_press_asks_for(model, ids):
    """attentions: the window queries' softmax over the head's rows, causal inside the window (float64 reference from
    the same queries and keys); hidden_states one row per call row; positions the call's."""
    press = ReadsAll(compression_ratio=0.5)
    s = model.new_session()
    s.forward(ids[:30], logits="none")  # a cached prefix: the call's rows follow it
    s.set_press(**press.c_config())
    s.forward(ids[30:], logits="none")
    c = model.config
    assert len(press.seen) == c["n_layers"]
    for v in press.seen:
        n, w, g, d = N, 8, c["n_heads"] // c["n_kv_heads"], c["head_dim"]
        assert v["keys"].shape == v["values"].shape == (c["n_kv_heads"], n, d) and (v["lengths"] == n).all()
        assert v["queries"].shape == (c["n_heads"], w, d) and v["attentions"].shape == (c["n_heads"], w, n)
        assert v["hidden_states"].shape == (N - 30, c["hidden"]) and np.isfinite(v["hidden_states"]).all()
        np.testing.assert_array_equal(v["positions"], np.arange(30, N))
        for hq in range(c["n_heads"]):
            k = v["keys"][hq // g].astype(np.float64)
            for i in range(w):
                vis = n - w + i + 1
                logit = k[:vis] @ v["queries"][hq, i].astype(np.float64) / np.sqrt(d)
                p = np.exp(logit - logit.max())
                p /= p.sum()
                # float32 softmax against float64: 1e-6 of the row's largest probability (measured 2e-7)
                np.testing.assert_allclose(v["attentions"][hq, i, :vis], p, rtol=0, atol=1e-6 * p.max())
                assert (v["attentions"][hq, i, vis:] == 0).all()
