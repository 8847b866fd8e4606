"""LUKVPress with budget curves this test writes ([99, layers, KV heads] .npy, the LU-KV repository's format): clear
errors when missing or wrong, kvpress parity (kvpress's press given the same curve as its _budget_curves; it masks,
we evict), a float64 NumPy reference of the head counts and the selection, and the wrapped press's own settings
(ExpectedAttentionStatsPress's statistics) reaching the engine. Fresh random curves each run (seed printed)."""
import numpy as np
import pytest

import kvpress_c
from hub_files import assert_head_near_ties, jaccards, kvpress_run, random_curve, random_stats, write_stats  # noqa: E402
from hub_presses_reference import expected_attention_given, lukv_counts, lukv_keep  # noqa: E402
from press_runs import prefill_and_greedy  # noqa: E402
from test_expected_attention_stats import default_side, side, tiny, tiny_llama, tiny_qwen3  # noqa: E402,F401

N_NEW = 8


def write_curve(path, curve):
    np.save(path, curve)
    return str(path)


def test_missing_or_wrong_curves_are_clear_errors(tmp_path, rng):
    with pytest.raises(ValueError, match="curve_path"):
        kvpress_c.LUKVPress(compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        kvpress_c.LUKVPress(compression_ratio=0.5, curve_path=str(tmp_path / "nope.npy"))
    with pytest.raises(ValueError, match=r"\[99, layers, KV heads\]"):
        kvpress_c.LUKVPress(compression_ratio=0.5, curve_path=write_curve(tmp_path / "c.npy", rng.uniform(0, 1, (98, 4, 2))))
    with pytest.raises(ValueError, match="finite"):
        kvpress_c.LUKVPress(compression_ratio=0.5, curve_path=write_curve(tmp_path / "n.npy", np.full((99, 4, 2), np.nan)))
    ok = write_curve(tmp_path / "ok.npy", random_curve(rng, 4, 2))
    with pytest.raises(ValueError, match="compression_ratio"):
        kvpress_c.LUKVPress(compression_ratio=1.0, curve_path=ok)
    with pytest.raises(ValueError, match="sink"):
        kvpress_c.LUKVPress(compression_ratio=0.5, sink=-1, curve_path=ok)
    with pytest.raises(ValueError, match="scorer press"):
        kvpress_c.LUKVPress(press=None, compression_ratio=0.5, curve_path=ok)
    with pytest.raises(ValueError, match="PyramidKVPress"):
        kvpress_c.LUKVPress(press=kvpress_c.PyramidKVPress(), compression_ratio=0.5, curve_path=ok)
    press = kvpress_c.LUKVPress(compression_ratio=0.5, curve_path=ok)  # a curve for 4 x 2 meets a 30 x 3 model
    model = kvpress_c.load_model()
    s = model.new_session()
    s.set_press(**press.c_config())
    with pytest.raises(ValueError, match=r"shape \(99, 4, 2\); this model needs \(99, 30, 3\)"):
        press.before_prefill(s, 10, model.config)


def test_the_curve_row_follows_kvpress():
    """round(100 ratio) - 1, clamped to [0, 98] (Python's round: halves to even, as kvpress)."""
    rows = {r: kvpress_c.presses.lukv.LUKVPress.target_index.fget(type("P", (), {"compression_ratio": r})())
            for r in (0.001, 0.005, 0.015, 0.5, 0.9, 0.994, 0.999)}
    assert rows == {0.001: 0, 0.005: 0, 0.015: 1, 0.5: 49, 0.9: 89, 0.994: 98, 0.999: 98}


def test_head_counts_equal_the_reference(tiny_llama, tmp_path, rng):
    """C's counts (the kept lengths) equal the float32 rule on fresh ratios: floors, the rest of the rounded total to
    the largest fractions, at least one row each (edge cases: every head pruned whole, a half, nothing)."""
    _, _, model, ids, _ = tiny_llama
    c = model.config
    cases = [rng.uniform(0, 1, 2) for _ in range(4)] + [np.array([1.0, 1.0]), np.array([0.0, 0.5]), np.array([0.0, 0.0])]
    for i, prune in enumerate(cases):
        curve = np.broadcast_to(prune, (99, c["n_layers"], c["n_kv_heads"]))
        press = kvpress_c.LUKVPress(press=kvpress_c.KnormPress(), compression_ratio=0.5, sink=0, window=0,
                                    curve_path=write_curve(tmp_path / f"c{i}.npy", curve))
        s = prefill_and_greedy(model, press, ids, 0)[3]
        np.testing.assert_array_equal(s.cache_lengths()[0], lukv_counts(prune, len(ids)), err_msg=str(prune))


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_lukv_matches_kvpress(side, tmp_path, rng, ratio):
    kvpress = pytest.importorskip("kvpress")
    _, hf, model, ids, keys = side
    c = model.config
    curve = random_curve(rng, c["n_layers"], c["n_kv_heads"])
    mine = kvpress_c.LUKVPress(compression_ratio=ratio, curve_path=write_curve(tmp_path / "curve.npy", curve))
    kept, out, _, _ = prefill_and_greedy(model, mine, ids, N_NEW)
    press = kvpress.LUKVPress(compression_ratio=ratio)
    press._budget_curves = curve
    theirs, scores, their_out = kvpress_run(hf, press, ids, keys, N_NEW, scorer=press.press)
    for l, row in enumerate(theirs):  # the counts: kvpress's own, and the reference's
        assert [len(k) for k in row] == [len(k) for k in kept[l]] == list(lukv_counts(curve[mine.target_index, l], len(ids)))
    jac = jaccards(kept, theirs)
    print(f"LUKV {'tiny' if side[0] else 'default'} {c['arch']} ratio {ratio}: mean Jaccard {np.mean(jac):.4f}, "
          f"min {np.min(jac):.4f}, greedy equal {out == their_out}")
    assert_head_near_ties(kept, theirs, [s for s in scores], rtol=1e-4)  # kvpress's fp32 scores near its cuts
    assert np.mean(jac) >= 0.99
    assert out == their_out


def test_lukv_equals_float64_reference(tiny_llama, tmp_path, rng):
    """The EA scores of each layer's cache (float64), raised at the sinks and window, each head's counted top rows;
    inside LUKVPress an ExpectedAttentionStatsPress's statistics reach the scorer."""
    from np_llama import NpLlama
    path, _, model, ids, _ = tiny_llama
    ref = NpLlama(path)
    curve = random_curve(rng, ref.L, ref.Hkv)
    mu, cov = random_stats(rng, ref.L, ref.H, ref.d)
    inner = kvpress_c.ExpectedAttentionStatsPress(stats_folder=write_stats(tmp_path / "s", mu, cov), epsilon=0.02)
    press = kvpress_c.LUKVPress(press=inner, compression_ratio=0.7, sink=5, window=3,
                                curve_path=write_curve(tmp_path / "c.npy", curve))
    s = model.new_session()
    s.set_press(record_scores=True, **press.c_config())
    press.before_prefill(s, len(ids), model.config)
    s.forward(np.asarray(ids, np.int32), logits="none")
    worst = []

    def check(l, q, attn, o, resid, past, cache):
        K = np.stack([cache[l][h]["k"] for h in range(ref.Hkv)])
        V = np.stack([cache[l][h]["v"] for h in range(ref.Hkv)])
        sc = expected_attention_given(K, V, mu[l].astype(np.float64), cov[l].astype(np.float64), ref.inv_freq,
                                      epsilon=0.02)
        want, protected = lukv_keep(sc, curve[69, l], 5, 3)
        got = np.stack([s.press_scores(l, h) for h in range(ref.Hkv)])
        worst.append(np.abs(got - protected).max() / np.abs(protected).max())
        for h in range(ref.Hkv):
            assert set(s.cache_positions(l, h).tolist()) == want[h], (l, h)  # no near-tie on this model

    ref.forward(ref.embed(ids), np.arange(len(ids)), ref.empty_cache(), hook=check)
    print(f"LUKV(EAStats) protected scores vs float64: max relative error {max(worst):.2e}")
    assert max(worst) < 1e-6  # fp32 against float64: measured 1.1e-7
