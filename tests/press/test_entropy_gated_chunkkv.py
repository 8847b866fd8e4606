"""EntropyGatedChunkKVPress (kvpress; an extension of ChunkKV): its selection against a float64 NumPy reference
on fresh random inputs, side by side with kvpress 0.5.5 on the tiny random llama model and the default model at
compression ratios 0.5 and 0.9 (kept positions and greedy answers), its errors, and the emulated device against
the CPU (tests/device/test_device.py, "entropy_gated_chunkkv")."""
import numpy as np
import pytest

import kvpress_c
from capi import SCORERS, press_compute, press_config
from kvpress_scorers_reference import entropy_gated_chunk_keep
from press_reference import knorm_scores, snapkv_scores


@pytest.mark.parametrize("scorer", ["knorm", "snapkv"])
@pytest.mark.parametrize("length,chunk,low,ratio", [(200, 10, 4, 0.5), (200, 10, 4, 0.9), (157, 8, 2, 0.7),
                                                    (33, 40, 4, 0.5), (91, 10, 1, 0.3)])
def test_entropy_gated_selection_matches_reference(rng, scorer, length, chunk, low, ratio):
    H, Hkv, d, w = 4, 2, 16, 8
    q = rng.standard_normal((min(40, length), H, d)) * 2
    k = rng.standard_normal((Hkv, length, d))
    v = rng.standard_normal((Hkv, length, d))
    extra = dict(window=w, kernel=5) if scorer == "snapkv" else dict(window=0, kernel=1)
    cfg = press_config(scorer=SCORERS[scorer], compression_ratio=ratio, chunk_length=chunk, low_entropy_chunk=low, **extra)
    scores, kept = press_compute(cfg, q, k, v)
    ref_scores = knorm_scores(k) if scorer == "knorm" else snapkv_scores(q, k, w, 5)
    # the scorers' own tolerances (test_presses.py): fp32 against fp64
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-6)
    budget = max(1, int(length * (1 - ratio)))
    want = entropy_gated_chunk_keep(scores, chunk, low, budget)  # the selection, in float64, on our scores
    for h in range(Hkv):
        np.testing.assert_array_equal(kept[h], want)
    assert len(want) == budget


def test_entropy_gated_reduces_a_spiky_chunk():
    """Hand-made scores: chunk 1 holds one huge token (high score, low entropy): it keeps only low tokens."""
    s = np.ones((1, 40))
    s[0, 15] = 100.0
    keep = entropy_gated_chunk_keep(s, 10, 2, 20)
    assert 15 in keep and len([r for r in keep if 10 <= r < 20]) == 2 and len(keep) == 20


def test_entropy_gated_errors_and_defaults():
    p = kvpress_c.EntropyGatedChunkKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5))
    assert (p.chunk_length, p.low_entropy_chunk_length) == (10, 4)  # kvpress's defaults
    with pytest.raises(ValueError, match="chunk_length > low_entropy_chunk_length"):
        kvpress_c.EntropyGatedChunkKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5), chunk_length=4)
    with pytest.raises(ValueError, match="low_entropy_chunk_length"):
        kvpress_c.EntropyGatedChunkKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5), low_entropy_chunk_length=0)
    with pytest.raises(ValueError, match="does not combine"):
        kvpress_c.EntropyGatedChunkKVPress(kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5)))


# ---- side by side with kvpress ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from test_wrapper_parity import default_side, run_kvpress, run_ours, tiny, tiny_archs  # noqa: E402,F401


def make(lib, inner, ratio, window):
    press = (lib.SnapKVPress(compression_ratio=ratio, window_size=window) if inner == "snapkv"
             else lib.KeyDiffPress(compression_ratio=ratio))
    return lib.EntropyGatedChunkKVPress(press)


def parity(hf, model, ids, keys, inner, ratio, window):
    theirs = run_kvpress(hf, make(kvpress, inner, ratio, window), ids, keys)
    ours = run_ours(model, make(kvpress_c, inner, ratio, window), ids)
    jac = [len(a & b) / len(a | b) for la, lb in zip(ours[0], theirs[0]) for a, b in zip(la, lb)]
    print(f"EntropyGatedChunkKV({inner}) ratio {ratio}: mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, "
          f"greedy equal {ours[1] == theirs[1]}")
    assert [len(a) for la in ours[0] for a in la] == [len(b) for lb in theirs[0] for b in lb], "kept counts differ"
    assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    assert ours[1] == theirs[1], f"greedy continuation differs: {ours[1]} vs {theirs[1]}"


def whole_chunk_window(n, chunk=10):
    """SnapKV gives its window rows one equal score (max + 1). Where a chunk keeps only some of them, kvpress picks
    by torch.topk's unspecified tie order and we the earlier rows: measured on the tiny model with window 16 (rows
    184..199 over the chunks 180..189 and 190..199), row 184 against 188 in every layer at 0.5 (Jaccard 0.980)
    and the greedy answers apart at 0.9. So the window here is made of whole chunks (the tail chunk and one
    more): each is kept whole or not at all."""
    return chunk + n % chunk


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("inner", ["snapkv", "keydiff"])
def test_tiny_model_entropy_gated_matches_kvpress(tiny_archs, inner, ratio):
    hf, model, ids, keys, _ = tiny_archs
    parity(hf, model, ids, keys, inner, ratio, window=whole_chunk_window(len(ids)))


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("inner", ["snapkv", "keydiff"])
def test_default_model_entropy_gated_matches_kvpress(default_side, inner, ratio):
    parity(*default_side, inner, ratio, window=whole_chunk_window(len(default_side[2])))
