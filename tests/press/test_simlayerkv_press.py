"""SimLayerKVPress (kvpress; SimLayerKV): its lazy-layer decision and kept rows against a float64 NumPy reference on
fresh random inputs, side by side with kvpress 0.5.5 on the tiny random llama model and the default model (lazy
layers keeping about half and a tenth of the prompt: kept positions and greedy answers), its errors, and the
emulated device against the CPU (tests/device/test_device.py, "simlayerkv")."""
import numpy as np
import pytest

import kvpress_c
from capi import SCORERS, press_compute, press_config
from kvpress_scorers_reference import finch_scores, simlayerkv_keep

SIMLAYER = SCORERS["simlayerkv"]


@pytest.mark.parametrize("n,H,Hkv,d,n_last,n_recent,n_initial", [(150, 4, 2, 16, 1, 40, 4), (150, 6, 3, 16, 5, 70, 2),
                                                                 (90, 4, 4, 32, 3, 10, 0)])
def test_simlayerkv_matches_reference(rng, n, H, Hkv, d, n_last, n_recent, n_initial):
    q = rng.standard_normal((n, H, d)) * 2
    k = rng.standard_normal((Hkv, n, d))
    k[:, :n_initial] += 2 * q[-1].reshape(Hkv, H // Hkv, d).mean(1)[:, None]  # sinks that draw attention
    v = rng.standard_normal((Hkv, n, d))
    mass, _ = simlayerkv_keep(q, k, 0.0, n_last, n_recent, n_initial)
    for threshold in (max(mass - 0.02, 0.0), min(mass + 0.02, 1.0), 1.0):  # lazy, busy, off
        cfg = press_config(scorer=SIMLAYER, window=n_last, kernel=1, n_sink=n_initial, n_recent=n_recent,
                           lazy_threshold=threshold)
        scores, kept = press_compute(cfg, q, k, v)
        _, ref = simlayerkv_keep(q, k, threshold, n_last, n_recent, n_initial)
        for h in range(Hkv):
            np.testing.assert_array_equal(kept[h], ref[h])
        # the window attention it decides from: double sums, rounded once to fp32 (measured ~6e-8 relative)
        np.testing.assert_allclose(scores, finch_scores(q, k, n_last, normalize=False), rtol=1e-6, atol=1e-7)
    assert mass > 0.02  # the thresholds above straddle a real mass


def test_simlayerkv_short_prompt_is_not_compressed(rng):
    q, k, v = rng.standard_normal((20, 2, 8)), rng.standard_normal((1, 20, 8)), rng.standard_normal((1, 20, 8))
    cfg = press_config(scorer=SIMLAYER, window=1, kernel=1, n_sink=4, n_recent=15, lazy_threshold=0.0)
    _, kept = press_compute(cfg, q, k, v)  # 20 <= 4 + 15 + 1: kvpress keeps every row (and warns)
    assert kept[0].tolist() == list(range(20))


def test_simlayerkv_errors_and_defaults():
    p = kvpress_c.SimLayerKVPress()
    assert (p.lazy_threshold, p.n_last, p.n_recent, p.n_initial) == (1.0, 1, 1024, 4)  # kvpress's defaults
    assert p.is_noop and not kvpress_c.SimLayerKVPress(0.9).is_noop
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        kvpress_c.SimLayerKVPress(lazy_threshold=1.5)
    with pytest.raises(ValueError, match="larger than n_last"):
        kvpress_c.SimLayerKVPress(0.5, n_last=8, n_recent=8)
    with pytest.raises(ValueError, match="n_last"):
        kvpress_c.SimLayerKVPress(0.5, n_last=0)


# ---- side by side with kvpress ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from test_wrapper_parity import default_side, run_kvpress, run_ours, tiny, tiny_archs  # noqa: E402,F401


def parity(hf, model, ids, keys, ratio, threshold):
    n_recent = int(len(ids) * (1 - ratio))  # a lazy layer keeps about 1 - ratio of the prompt
    theirs = run_kvpress(hf, kvpress.SimLayerKVPress(lazy_threshold=threshold, n_recent=n_recent), ids, keys)
    ours = run_ours(model, kvpress_c.SimLayerKVPress(lazy_threshold=threshold, n_recent=n_recent), ids)
    jac = [len(a & b) / len(a | b) for la, lb in zip(ours[0], theirs[0]) for a, b in zip(la, lb)]
    lazy = sum(len(lb[0]) < len(ids) for lb in theirs[0])
    print(f"SimLayerKV n_recent {n_recent} threshold {threshold}: {lazy} of {len(theirs[0])} layers lazy, mean Jaccard "
          f"{np.mean(jac):.4f}, min {np.min(jac):.4f}, greedy equal {ours[1] == theirs[1]}")
    assert [len(a) for la in ours[0] for a in la] == [len(b) for lb in theirs[0] for b in lb], "kept counts differ"
    assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    assert ours[1] == theirs[1], f"greedy continuation differs: {ours[1]} vs {theirs[1]}"
    return lazy


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_tiny_model_simlayerkv_matches_kvpress(tiny_archs, ratio):
    hf, model, ids, keys, _ = tiny_archs
    lazy = [parity(hf, model, ids, keys, ratio, t) for t in (0.05, 0.2, 0.5)]
    assert max(lazy) > 0  # the decision was exercised


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_default_model_simlayerkv_matches_kvpress(default_side, ratio):
    hf, model, ids, keys = default_side
    lazy = [parity(hf, model, ids, keys, ratio, t) for t in (0.5, 0.8, 0.9)]
    assert max(lazy) > 0 and min(lazy) < len(keys)  # lazy and busy layers both occur
