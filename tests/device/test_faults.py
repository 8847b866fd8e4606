"""A device call that fails loses nothing: every point at which a device operation can fail, tried.

The emulated device fails its (n+1)-th operation from now once when told (set_device_option
'fail_after' n), with the status a CUDA error gives (RuntimeError). Each test runs one call with the
fault at operation 0, 1, 2, ... until the call gets through, and after every failure checks what the
engine promises: the session's position, cache lengths and kept positions are as before the call (or,
once a press has compacted a cache, the session refuses to go on until reset), device memory comes back,
and the call that finally succeeds gives the logits of a session that never failed.

Every storage type of the K/V cache (issue 27) goes through the same calls: rows stored alone (f16, bf16, q8_0)
and KIVI's blocks with their f32 residual, whose growth (a resize in the call), commit (after each layer's
attention: a residual that fills is quantised, rows of earlier calls with it) and compaction can fail at every
point; the state compared after each failure includes every row of the cache as read back.

The CUDA backend has no injected faults: on `cuda` (where a GPU is; skipped with the build's reason
otherwise) a real one is tried, an allocation larger than the card (cudaMalloc refuses: a non-sticky error,
MemoryError).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvpress_c
from kvpress_c import QuantizedCache, _core
from capi import SCORERS as S, why_no_cuda
from random_llama import write_random_llama

SHAPE = dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512)
# None: the device's own. KIVI: a residual of 64 over blocks of 32 (a first call of 50 rows waits, the next fills
# it), and blocks of 4 with a residual of 6 (quantised every few decode steps, rows of earlier calls with them)
KV_TYPES = [None, "f16", "bf16", "q8_0", QuantizedCache(4, 32, 64), QuantizedCache(2, 4, 6)]
KV_IDS = ["native", "f16", "bf16", "q8_0", "kivi4-g32-r64", "kivi2-g4-r6"]
kv_types = pytest.mark.parametrize("kv_cache", KV_TYPES, ids=KV_IDS)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("faults")), **SHAPE)


@pytest.fixture(scope="module")
def model(path):
    return kvpress_c.load_model(path, device="emulated")


def with_faults(call, after_failure):
    """call() with the fault at operation k = 0, 1, ... until it succeeds; after_failure() after each
    failure. Returns (failures, the successful call's result)."""
    for k in itertools.count():
        _core.set_device_option("emulated", "fail_after", k)
        try:
            out = call()
        except RuntimeError as e:
            assert "injected fault" in str(e), e
            after_failure()
            continue
        finally:
            _core.set_device_option("emulated", "fail_after", -1)
        return k, out


def state(s, L, Hkv):
    """Position, lengths, kept positions and every row as read back (bytes: NaN-safe and exact)."""
    return (s.position, s.cache_lengths().tolist(), [[s.cache_positions(l, h).tolist() for h in range(Hkv)] for l in range(L)],
            [[b"".join(x.tobytes() for x in s.cache_rows(l, h)) for h in range(Hkv)] for l in range(L)])


def same_logits(a, b):
    # the same device, the same kernels, the same inputs: equal up to the threads' summation order
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


@kv_types
@pytest.mark.parametrize("n,logits", [(40, "last"), (40, "none"), (1, "last"), (1, "none"), (70, "all")])
def test_a_failed_forward_loses_nothing(model, rng, n, logits, kv_cache):
    L, Hkv, V = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"]
    first, more = rng.integers(3, V, size=50).astype(np.int32), rng.integers(3, V, size=n).astype(np.int32)
    s = model.new_session(kv_cache=kv_cache)
    s.forward(first, logits="none")
    before = state(s, L, Hkv)

    def unchanged():
        assert state(s, L, Hkv) == before

    failures, got = with_faults(lambda: s.forward(more, logits=logits), unchanged)
    # every layer's kernels, the logits and (without logits) the end-of-call sync were failure points
    assert failures >= 8 * L + (1 if logits == "none" else 2)
    ref = model.new_session(kv_cache=kv_cache)
    ref.forward(first, logits="none")
    want = ref.forward(more, logits=logits)
    assert state(s, L, Hkv) == state(ref, L, Hkv)
    if logits != "none":
        same_logits(got, want)
    nxt = np.array([7], np.int32)
    same_logits(s.forward(nxt, logits="last"), ref.forward(nxt, logits="last"))


@kv_types
@pytest.mark.parametrize("logits", ["last", "none"])
def test_a_failed_decode_graph_replay_loses_nothing(model, rng, logits, kv_cache):
    """A replayed decode graph that faults: the device lengths it moved follow the host's again (KIVI blocks of 4
    with a residual of 6: replayed steps quantise the residual)."""
    L, Hkv, V = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"]
    ids = rng.integers(3, V, size=60).astype(np.int32)
    s, ref = model.new_session(kv_cache=kv_cache), model.new_session(kv_cache=kv_cache)
    for x in (s, ref):
        x.forward(ids[:50], logits="none")
    s.set_decode_graphs(True)
    s.forward(ids[50:51], logits="last")  # the eager first step, then graphs
    ref.forward(ids[50:51], logits="last")
    for t in range(51, 55):
        before = state(s, L, Hkv)
        _, got = with_faults(lambda: s.forward(ids[t:t + 1], logits=logits), lambda: (state(s, L, Hkv) == before) or pytest.fail("state moved"))
        want = ref.forward(ids[t:t + 1], logits=logits)
        assert state(s, L, Hkv) == state(ref, L, Hkv)
        if logits != "none":
            same_logits(got, want)
    info = s.graph_info
    assert info["enabled"] and info["error"] == "" and info["graph_steps"] >= 4


@kv_types
def test_a_failed_batched_decode_loses_nothing(model, rng, kv_cache):
    L, Hkv, V = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"]
    sessions, refs = [], []
    # sessions of different types in one batch; 3 decode steps first, so that the batched step fills KIVI's residual
    # (blocks of 32, residual 64: 60 + 4 rows; blocks of 4, residual 6: of 26 rows 24 quantised, 2 + 4 waiting)
    for n, t in zip((26, 60, 7), (kv_cache, kv_cache, "f16")):
        ids = rng.integers(3, V, size=n + 3).astype(np.int32)
        a, b = model.new_session(kv_cache=t), model.new_session(kv_cache=t)
        for x in (a, b):
            x.forward(ids[:n], logits="none")
            for i in range(n, n + 3):
                x.forward(ids[i:i + 1], logits="none")
        sessions.append(a)
        refs.append(b)
    nxt = rng.integers(3, V, size=3).astype(np.int32)
    before = [state(s, L, Hkv) for s in sessions]
    failures, got = with_faults(lambda: _core.forward_batch(sessions, nxt),
                                lambda: [state(s, L, Hkv) for s in sessions] == before or pytest.fail("state moved"))
    assert failures >= 8 * L + 2
    want = _core.forward_batch(refs, nxt)
    same_logits(got, want)
    assert [state(s, L, Hkv) for s in sessions] == [state(s, L, Hkv) for s in refs]


@kv_types
def test_a_failed_compressed_prefill_refuses_until_reset(model, rng, kv_cache):
    """Before the press has evicted anything a failed prefill is rolled back and the session goes on; after,
    the evicted rows cannot come back, so the session says to reset it (it never attends to a partial cache)."""
    L, Hkv, V = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"]
    ids = rng.integers(3, V, size=120).astype(np.int32)
    press = dict(scorer=S["snapkv"], compression_ratio=0.5, window=16)
    s = model.new_session(kv_cache=kv_cache)
    s.set_press(**press)
    outcomes = []

    def after():
        assert s.position == 0 and (s.cache_lengths() == 0).all()
        try:
            s.forward(ids[:1], logits="none")  # no fault pending: goes through unless the session must be reset
            outcomes.append("went on")
        except ValueError as e:
            assert "reset()" in str(e)
            outcomes.append("refused")
        s.reset()

    failures, _ = with_faults(lambda: s.forward(ids, logits="none"), after)
    assert failures == len(outcomes)
    # failures before layer 0's compaction go on; every one after it (later layers, the sync) refuses
    first = outcomes.index("refused")
    assert 0 < first and set(outcomes[first:]) == {"refused"}
    ref = model.new_session(kv_cache=kv_cache)
    ref.set_press(**press)
    ref.forward(ids, logits="none")
    assert state(s, L, Hkv) == state(ref, L, Hkv)


@kv_types
def test_a_failed_shared_prefill_leaves_every_session_empty(model, rng, kv_cache):
    L, Hkv, V = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"]
    ids = rng.integers(3, V, size=80).astype(np.int32)
    leader, followers = model.new_session(), [model.new_session(kv_cache=kv_cache) for _ in range(2)]
    followers[0].set_press(scorer=S["knorm"], compression_ratio=0.5)

    def empty():
        for x in (leader, *followers):
            assert x.position == 0 and (x.cache_lengths() == 0).all()

    with_faults(lambda: leader.forward_shared(ids, followers), empty)
    for f, press in zip(followers, (dict(scorer=S["knorm"], compression_ratio=0.5), None)):
        alone = model.new_session(kv_cache=kv_cache)
        if press:
            alone.set_press(**press)
        alone.forward(ids, logits="none")
        assert state(f, L, Hkv) == state(alone, L, Hkv)


def test_a_failed_load_or_new_session_releases_what_it_took(path, model):
    """Every allocation and upload of a load can fail: the device's memory comes back each time."""
    base = kvpress_c.memory_stats("emulated")["current"]

    def nothing_held():
        assert kvpress_c.memory_stats("emulated")["current"] == base

    failures, m = with_faults(lambda: kvpress_c.load_model(path, device="emulated"), nothing_held)
    assert failures > 3 * SHAPE["layers"]  # an allocation and an upload per tensor at least
    ids = np.arange(3, 40, dtype=np.int32)
    same_logits(m.logits(ids), model.logits(ids))
    del m
    nothing_held()
    with_faults(lambda: model.new_session(capacity=64).forward(ids, logits="none"), nothing_held)


@kv_types
def test_a_failed_restore_append_or_kvgrad_score_loses_nothing(model, rng, kv_cache):
    """Rows appended from embeddings (RestoreKV: a host forward with LoRA, then kv_write into every layer) are rolled
    back from every layer when any write fails; KVgrad's scoring only reads the cache."""
    L, Hkv, V, D = model.config["n_layers"], model.config["n_kv_heads"], model.config["vocab"], model.config["hidden"]
    ids = rng.integers(3, V, size=60).astype(np.int32)
    emb = rng.standard_normal((5, D)).astype(np.float32)
    lora = [(1, 0, rng.standard_normal((2, D)) * 0.1, rng.standard_normal((D, 2)) * 0.1, 2.0)]
    s = model.new_session(kv_cache=kv_cache)
    s.forward(ids, logits="none")
    before = state(s, L, Hkv)

    def unchanged():
        assert state(s, L, Hkv) == before

    rep = np.r_[rng.integers(3, V, size=4), ids[10:40]].astype(np.int32)
    failures, scores = with_faults(lambda: s.kvgrad_score(rep, 10, 40), unchanged)
    assert failures >= L  # one kv_read per layer at least
    ref = model.new_session(kv_cache=kv_cache)
    ref.forward(ids, logits="none")
    np.testing.assert_array_equal(scores, ref.kvgrad_score(rep, 10, 40))
    failures, _ = with_faults(lambda: s.append_embeddings(emb, lora=lora), unchanged)
    assert failures >= L  # the writes of every layer were failure points
    ref.append_embeddings(emb, lora=lora)
    assert state(s, L, Hkv) == state(ref, L, Hkv)
    for l in range(L):
        for h in range(Hkv):
            for a, b in zip(s.cache_rows(l, h), ref.cache_rows(l, h)):
                np.testing.assert_array_equal(a, b)


def test_a_real_cuda_allocation_failure_loses_nothing(path, rng):
    """A session announcing more tokens than the card holds: its first forward fails (cudaMalloc refused: a
    MemoryError naming the bytes), the session is as before, the device's memory comes back, and the model
    goes on giving the logits it gave before (the error did not lose the CUDA context)."""
    if not kvpress_c.cuda_available():
        pytest.skip(why_no_cuda() or "no CUDA backend")
    m = kvpress_c.load_model(path, device="cuda")
    ids = rng.integers(3, SHAPE["vocab"], size=40).astype(np.int32)
    want = m.logits(ids)
    Hkv = m.config["n_kv_heads"]
    base = kvpress_c.memory_stats("cuda")["current"]
    total = kvpress_c.memory_stats("cuda")["device_total"]
    d = SHAPE["hidden"] // SHAPE["heads"]
    per_token = 2 * Hkv * d * 2  # K and V rows of one layer in bf16
    s = m.new_session(capacity=2 * total // per_token)  # one layer's reservation is twice the card
    with pytest.raises(MemoryError, match="out of memory"):
        s.forward(ids, logits="none")
    assert s.position == 0 and (s.cache_lengths() == 0).all()
    del s
    assert kvpress_c.memory_stats("cuda")["current"] == base
    same_logits(m.logits(ids), want)
    ok = m.new_session()
    ok.forward(ids, logits="none")
    assert ok.position == len(ids)
