"""ChunkPress (kvpress; FINCH's per-chunk selection): against a float64 NumPy reference on fresh random
inputs, side by side with kvpress 0.5.5 on the tiny random llama model and the default model at compression
ratios 0.5 and 0.9 (kept positions and greedy answers), its errors, and the emulated device against the CPU
(tests/device/test_device.py, "chunk_press-*")."""
import numpy as np
import pytest

import kvpress_c
from capi import SCORERS, press_compute, press_config
from kvpress_scorers_reference import chunk_press, keydiff_scores, lagkv_scores
from press_reference import knorm_scores

REFERENCES = {  # scorer -> (config fields, float64 scores of one chunk)
    "knorm": ({}, lambda K, V: knorm_scores(K)),
    "keydiff": ({}, lambda K, V: keydiff_scores(K)),
    "lagkv": (dict(lag_size=8, n_sink=2, cross_scoring=1), lambda K, V: lagkv_scores(K, V, 2, 8, True)),
}


@pytest.mark.parametrize("scorer", sorted(REFERENCES))
@pytest.mark.parametrize("length,chunk,ratio", [(200, 64, 0.5), (200, 64, 0.9), (97, 30, 0.7), (40, 100, 0.5),
                                                (65, 1, 0.5)])
def test_chunk_press_matches_reference(rng, scorer, length, chunk, ratio):
    H, Hkv, d = 4, 2, 16
    q = rng.standard_normal((8, H, d))
    k = rng.standard_normal((Hkv, length, d)) + rng.standard_normal(d)  # a shared direction: KeyDiff's anchor
    v = rng.standard_normal((Hkv, length, d))
    extra, ref_fn = REFERENCES[scorer]
    cfg = press_config(scorer=SCORERS[scorer], window=0, kernel=1, compression_ratio=ratio, chunk_press=chunk, **extra)
    scores, kept = press_compute(cfg, q, k, v)
    ref, ref_kept = chunk_press(ref_fn, k, v, chunk, ratio)
    # fp32 norms / cosines / softmaxes of 16 values against fp64: measured max abs error ~5e-7
    np.testing.assert_allclose(scores, ref, atol=3e-6)
    for h in range(Hkv):
        assert len(kept[h]) == len(ref_kept[h])
        for r in set(kept[h].tolist()) ^ set(ref_kept[h].tolist()):  # only near-ties of the chunk's cut may differ
            c0 = r // chunk * chunk
            s = np.sort(ref[h, c0:c0 + chunk])[::-1]
            cut = s[max(1, int(len(s) * (1 - ratio))) - 1]
            assert abs(ref[h, r] - cut) <= 3e-6, f"{scorer} head {h}: row {r} is not a near-tie"


def test_chunk_press_streaming_keeps_each_chunks_sinks_and_recent(rng):
    """StreamingLLM per chunk (no float scores to compare): every chunk keeps its own first n_sink and last rows."""
    q, k, v = rng.standard_normal((8, 4, 16)), rng.standard_normal((2, 150, 16)), rng.standard_normal((2, 150, 16))
    _, kept = press_compute(press_config(scorer=SCORERS["streaming"], window=0, compression_ratio=0.5, n_sink=2,
                                         chunk_press=64), q, k, v)
    want = []
    for i in range(0, 150, 64):
        rows = min(64, 150 - i)
        n = max(1, int(rows * 0.5))
        want += [i + r for r in range(rows) if r < 2 or r >= rows - (n - 2)]
    for h in range(2):
        assert kept[h].tolist() == want


def test_chunk_press_errors():
    with pytest.raises(NotImplementedError, match="keys and values"):
        kvpress_c.ChunkPress(kvpress_c.SnapKVPress(compression_ratio=0.5))
    with pytest.raises(ValueError, match="compression_ratio"):
        kvpress_c.ChunkPress(kvpress_c.KnormPress(budget=64))
    with pytest.raises(ValueError, match="chunk_length"):
        kvpress_c.ChunkPress(kvpress_c.KnormPress(compression_ratio=0.5), chunk_length=0)
    with pytest.raises(ValueError, match="scorer press"):
        kvpress_c.ChunkPress(kvpress_c.AdaKVPress(kvpress_c.KnormPress(compression_ratio=0.5)))
    p = kvpress_c.ChunkPress(kvpress_c.KnormPress(compression_ratio=0.3))
    assert (p.chunk_length, p.compression_ratio) == (1024, 0.3)  # kvpress's default and the inner press's ratio


# ---- side by side with kvpress ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from test_wrapper_parity import default_side, run_kvpress, run_ours, tiny  # noqa: E402,F401


def make(lib, inner, ratio):
    press = {"knorm": lib.KnormPress, "keydiff": lib.KeyDiffPress}[inner](compression_ratio=ratio)
    return lib.ChunkPress(press, chunk_length=64)


def parity(hf, model, ids, keys, inner, ratio):
    theirs = run_kvpress(hf, make(kvpress, inner, ratio), ids, keys)
    ours = run_ours(model, make(kvpress_c, inner, ratio), ids)
    jac = [len(a & b) / len(a | b) for la, lb in zip(ours[0], theirs[0]) for a, b in zip(la, lb)]
    assert [len(a) for la in ours[0] for a in la] == [len(b) for lb in theirs[0] for b in lb], "kept counts differ"
    print(f"ChunkPress({inner}) ratio {ratio}: mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, "
          f"greedy equal {ours[1] == theirs[1]}")
    if inner == "knorm":  # repeated tokens at layer 0 have exactly equal key norms: a difference must swap such rows
        for l, (la, lb) in enumerate(zip(ours[0], theirs[0])):
            for h, (a, b) in enumerate(zip(la, lb)):
                norms = keys[l][h].double().norm(dim=-1).numpy()
                for r in a ^ b:
                    other = b - a if r in a else a - b
                    assert min(abs(norms[r] - norms[q]) for q in other) <= 1e-5 * norms.max(), \
                        f"layer {l} head {h}: position {r} differs and has no equal-norm partner"
    else:
        assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    assert ours[1] == theirs[1], f"greedy continuation differs: {ours[1]} vs {theirs[1]}"


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("inner", ["knorm", "keydiff"])
def test_tiny_model_chunk_press_matches_kvpress(tiny, inner, ratio):
    hf, model, ids, keys, _ = tiny
    parity(hf, model, ids, keys, inner, ratio)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("inner", ["knorm", "keydiff"])
def test_default_model_chunk_press_matches_kvpress(default_side, inner, ratio):
    parity(*default_side, inner, ratio)
