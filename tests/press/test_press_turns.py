"""The presses that run their own prefill, on a session that already holds a cache (a conversation's later turn):
KVzip's scores and eviction, KVgrad's scores and TAKE's chunked prefill over a compressed (ragged) cache against
float64 NumPy references that hold the same rows by position (tests/reference/), for both press scopes."""
import numpy as np
import pytest

import kvpress_c
from kvgrad_reference import fd_residual_gradient, kvgrad_scores
from kvpress_scorers_reference import kvzip_kept_held, kvzip_scores_held
from method_reference import take_prefill
from np_llama import NpLlama
from random_llama import write_random_llama

VOCAB = 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("turns") / "m"), layers=4, hidden=64, heads=4, kv_heads=2,
                              ffn=96, vocab=VOCAB, seed=3)


def _held(s, L, Hkv):
    return [[s.cache_positions(l, h) for h in range(Hkv)] for l in range(L)]


def _same_rows(ref_cache, positions):
    """The reference's cache cut to the rows the engine holds (by position)."""
    for l, layer in enumerate(ref_cache):
        for h, head in enumerate(layer):
            keep = np.flatnonzero(np.isin(head["pos"], positions[l][h]))
            layer[h] = {k: v[keep] for k, v in head.items()}


def _compressed_turn(model, ref, rng, n, n2):
    """A context of n tokens evicted by KVzip's eviction of random scores (ragged heads), then a turn of n2 tokens:
    the engine's session and the reference's cache holding the same rows."""
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    ctx, turn = rng.integers(3, VOCAB, n).astype(np.int32), rng.integers(3, VOCAB, n2).astype(np.int32)
    s = model.new_session()
    s.forward(ctx, logits="last")
    s.kvzip_evict(rng.random((L, Hkv, n)).astype(np.float32), 0.5, n_sink=4)
    s.forward(turn, logits="last")
    cache = ref.empty_cache()
    ref.forward(ref.embed(ctx), np.arange(n), cache)
    _same_rows(cache, _held(s, L, Hkv))
    ref.forward(ref.embed(turn), n + np.arange(n2), cache)
    for l in range(L):
        for h in range(Hkv):
            assert np.array_equal(cache[l][h]["pos"], s.cache_positions(l, h))
    return s, cache


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("plus", [False, True])
def test_kvzip_on_a_compressed_cache_matches_float64_model(folder, rng, device, plus):
    """kvzip_score of a chunk spanning the evicted context and the new turn against the reference over the rows
    each head holds (0 where it holds none); then the eviction of the turn's positions only against
    kvzip_kept_held (global and layerwise), the earlier rows kept."""
    model, ref = kvpress_c.load_model(folder, device=device), NpLlama(folder)
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    n, n2, m = int(rng.integers(50, 90)), int(rng.integers(20, 40)), int(rng.integers(15, 30))
    s, cache = _compressed_turn(model, ref, rng, n, n2)
    start, end = int(rng.integers(0, n - 10)), int(rng.integers(n + 1, n + n2 + 1))
    rep = rng.integers(3, VOCAB, m).astype(np.int32)
    want = []

    def grab(l, q, attn, o, resid, past, c):
        hn = ref.rmsnorm(resid, ref.W(f"model.layers.{l}.input_layernorm.weight")) if plus else None
        heads = [(c[l][h]["k"], c[l][h]["v"], c[l][h]["pos"]) for h in range(Hkv)]
        want.append(kvzip_scores_held(q, heads, start, end, 4, hn, ref.W(f"model.layers.{l}.self_attn.o_proj.weight")))

    ref.forward(ref.embed(rep), n + n2 + np.arange(m), cache, hook=grab)
    before = _held(s, L, Hkv)
    got = s.kvzip_score(rep, start, end, n_sink=4, plus=plus).astype(np.float64)
    want = np.stack(want)
    assert s.position == n + n2 and all(np.array_equal(a, b) for x, y in zip(before, _held(s, L, Hkv)) for a, b in zip(x, y))
    assert np.array_equal(got == 0, want == 0)  # the positions a head does not hold score 0, the others > 0
    # measured max relative error: cpu 1.5e-6 .. 2e-6 (fp32 vs fp64); emulated (bf16 K/V/q on this random model's
    # sharp attention) 2.8e-2 .. 6.3e-2 over 14 runs, as on its full cache (4.0e-2 .. 7.4e-2, 6 seeds)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"KVzip{'+' if plus else ''} {device} on a compressed cache: rel err {err:.2e}")
    assert err < (1e-5 if device == "cpu" else 0.15), err
    for layerwise in (False, True):
        e = model.new_session(0)
        e.copy_cache_from(s)
        sc = rng.random((L, Hkv, n2)).astype(np.float32)
        e.kvzip_evict(sc, 0.4, layerwise=layerwise, n_sink=4, first=n)
        kept = kvzip_kept_held(before, sc, n, 0.4, 4, layerwise)
        for l in range(L):
            for h in range(Hkv):
                assert e.cache_positions(l, h).tolist() == kept[l][h].tolist(), (layerwise, l, h)


def test_kvzip_eviction_of_every_position_on_a_compressed_cache(folder, rng):
    """compress="all": every position scored, the rows held (ragged) ranked together, int(C ratio) of the C held
    go; the cache bytes drop by the rows evicted."""
    model, ref = kvpress_c.load_model(folder), NpLlama(folder)
    L, Hkv, d = model.config["n_layers"], model.config["n_kv_heads"], model.config["head_dim"]
    s, _ = _compressed_turn(model, ref, rng, 60, 30)
    before = _held(s, L, Hkv)
    sc = rng.random((L, Hkv, s.position)).astype(np.float32)
    s.kvzip_evict(sc, 0.3, n_sink=4)
    kept = kvzip_kept_held(before, sc, 0, 0.3, 4)
    held = sum(len(p) for x in before for p in x)
    assert sum(len(p) for x in kept for p in x) == held - int(held * 0.3)
    for l in range(L):
        for h in range(Hkv):
            assert s.cache_positions(l, h).tolist() == kept[l][h].tolist()
    c = model.new_session(0)
    c.copy_cache_from(s)  # arenas sized to the rows: K and V of d floats, a position
    assert c.cache_bytes == int(s.cache_lengths().sum()) * (2 * d * 4 + 8)


def test_kvgrad_on_a_compressed_cache_matches_float64_model(folder, rng):
    """KVgrad's scores over a ragged cache against the float64 reference fed the engine's gradient norms, and those
    norms at a few (layer, row) against the reference's central differences."""
    model, ref = kvpress_c.load_model(folder, weights="fp32"), NpLlama(folder)
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    n, n2 = int(rng.integers(40, 60)), int(rng.integers(15, 25))
    s, cache = _compressed_turn(model, ref, rng, n, n2)
    start, end = int(rng.integers(0, n - 10)), int(rng.integers(n + 1, n + n2 + 1))
    rep = rng.integers(3, VOCAB, 12).astype(np.int32)
    before = _held(s, L, Hkv)
    scores, norms = s.kvgrad_score(rep, start, end, n_sink=4, grad_norms=True)
    assert all(np.array_equal(a, b) for x, y in zip(before, _held(s, L, Hkv)) for a, b in zip(x, y))
    want = kvgrad_scores(ref, cache, rep, start, end, 4, norms.astype(np.float64), position=n + n2)
    err = np.abs(scores - want).max() / np.abs(want).max()
    worst = 0.0
    for l, p in [(0, 0), (L - 1, len(rep) - 1), (int(rng.integers(L)), int(rng.integers(len(rep))))]:
        fd = np.linalg.norm(fd_residual_gradient(ref, cache, rep, l, p, position=n + n2))
        worst = max(worst, abs(norms[l, p] - fd) / fd)
    print(f"KVgrad on a compressed cache: scores rel err {err:.2e}, gradient norms vs central differences {worst:.2e}")
    assert err < 1e-5 and worst < 1e-5  # fp32 vs float64: measured on the full cache <= 8.7e-7 and <= 5.0e-7


@pytest.mark.parametrize("scope", ["call", "cache"])
@pytest.mark.parametrize("delayed", [True, False])
def test_take_after_a_compressed_past_matches_numpy(folder, rng, scope, delayed):
    """Two TAKE calls on one session (a conversation's turns): the second scores every row held ('cache') or only
    its own rows, the first call's kept as they were ('call'); kept positions exact, logits against the float64
    reference."""
    model, ref = kvpress_c.load_model(folder, weights="fp32"), NpLlama(folder)
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    first, second = rng.integers(3, VOCAB, 70).tolist(), rng.integers(3, VOCAB, 50).tolist()
    kw = dict(budget=20, chunk_size=32, warmup_budget=40, warmup_layers=L // 2 + 1, kernel=7, alpha=0.2, delayed=delayed)
    c_kw = dict(chunk_size=32, warmup_budget=40, warmup_layers=L // 2 + 1, kernel=7, alpha=0.2, delayed=delayed)
    s = model.new_session()
    s.set_press_scope(scope)
    s.prefill_take(np.array(first, dtype=np.int32), np.array(first[-6:], dtype=np.int32), 20, **c_kw)
    after_first = _held(s, L, Hkv)
    logits = s.prefill_take(np.array(second, dtype=np.int32), np.array(second[-6:], dtype=np.int32), 20, **c_kw)
    cache, _ = take_prefill(ref, first, first[-6:], **kw)
    cache, ref_logits = take_prefill(ref, second, second[-6:], **kw, cache=cache, pos0=70, scope=scope)
    for l in range(L):
        for h in range(Hkv):
            got = s.cache_positions(l, h)
            np.testing.assert_array_equal(got, cache[l][h]["pos"], err_msg=f"layer {l} head {h}")
            if scope == "call":  # the first call's rows stay, the second's are cut to the budget
                n0 = len(after_first[l][h])
                assert np.array_equal(got[:n0], after_first[l][h]) and len(got) - n0 <= 20
            else:
                assert len(got) <= 20
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err < 1e-4, err  # fp32 vs float64, as test_take_matches_numpy_chunked_prefill
    assert s.position == 120


def test_take_delayed_eviction_refuses_layers_holding_other_rows(folder, rng):
    """Delayed eviction prunes the warm-up layers with the last one's choice: a cache whose layers hold other rows (a
    press that evicts per layer) is refused, and the session can be reset and reused."""
    model = kvpress_c.load_model(folder, weights="fp32")
    s = model.new_session()
    s.set_press(**kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=4).c_config())
    s.forward(rng.integers(3, VOCAB, 60).astype(np.int32), logits="last")
    s.set_press(None)
    ids = rng.integers(3, VOCAB, 30).astype(np.int32)
    with pytest.raises(NotImplementedError, match="delayed=False"):
        s.prefill_take(ids, ids[-6:], 20, chunk_size=32, warmup_layers=3)
    s.reset()
    s.prefill_take(ids, ids[-6:], 20, chunk_size=32, warmup_layers=3)
    assert s.position == 30
