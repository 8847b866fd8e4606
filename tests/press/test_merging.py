"""Value merging on eviction (csrc/press/merge.c): MergingPress and CAMPress's merge against float64 NumPy
references (tests/reference/merge_reference.py) on fresh random inputs, and against kvpress 0.5.5's own
MergingPress.merge and CAMPress.compress called on the same tensors (float64); then the session path: a
compressed prefill's kept values equal the reference merge of the uncompressed prefill's rows."""
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

import capi
import kvpress_c
from merge_reference import cam_merge, cam_uniforms, merge_similar

# C: float64 accumulation, float32 inputs and outputs. Measured max |C - float64 reference| / max |v| over
# 400 random draws: 5.2e-8 (MergingPress), 5.3e-8 (CAM): the float32 rounding of the output; bound 2e-6.
RTOL = 2e-6


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("threshold,fraction", [(0.0, 1.0), (0.3, 1.0), (0.0, 0.75), (0.2, 0.5), (0.0, 0.1)])
def test_merge_similar_matches_reference(rng, threshold, fraction):
    for _ in range(20):
        n, d = int(rng.integers(2, 80)), int(rng.choice([4, 16, 64]))
        k = rng.standard_normal((n, d)).astype(np.float32)
        k[rng.integers(0, n)] *= 0  # a zero key: the norm clamp
        v = rng.standard_normal((n, d)).astype(np.float32)
        keep = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
        want = merge_similar(k, v, keep, threshold, fraction)
        assert rel(capi.merge_similar(k, v, keep, threshold, fraction), want) < RTOL


@pytest.mark.parametrize("budget", [1, 4, 32])
def test_cam_merge_matches_reference(rng, budget):
    for _ in range(20):
        Hkv, n, d = int(rng.integers(1, 4)), int(rng.integers(2, 90)), int(rng.choice([4, 16]))
        scores = rng.standard_normal((Hkv, n)).astype(np.float32)
        scores[:, rng.integers(0, n, 5)] = 0.5  # ties across heads: lower row kept, later row merged first
        attn = rng.uniform(0, 1, (Hkv, n)).astype(np.float32)
        attn[:, rng.integers(0, n, 3)] = 0  # 0 / 0 and x / 0 probabilities
        v = rng.standard_normal((Hkv, n, d)).astype(np.float32)
        target, n_merge = int(rng.integers(1, n + 1)), int(rng.integers(0, n + 2))
        seed, layer, event = int(rng.integers(0, 2**63)), int(rng.integers(0, 30)), int(rng.integers(0, 9))
        keep, out = capi.cam_merge(scores, attn, v, target, n_merge, budget, seed, layer, event)
        want_keep, want = cam_merge(scores, attn, v, target, n_merge, budget, seed, layer, event)
        assert (keep == want_keep).all()
        assert rel(out, want) < RTOL


def test_cam_draws_are_uniform():
    """The Bernoulli stream: 40k draws of one layer and event, uniform on [0, 1) (KS distance ~1/sqrt(n))."""
    u = np.sort(cam_uniforms(7, 3, 1, 4, 10000).ravel())
    assert np.abs(u - np.arange(1, len(u) + 1) / len(u)).max() < 0.01


# -- kvpress's own functions on the same tensors ------------------------------------------------------

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")


@pytest.mark.parametrize("threshold,fraction", [(0.0, 1.0), (0.25, 1.0), (0.0, 0.75)])
def test_merge_similar_matches_kvpress(rng, threshold, fraction):
    """kvpress MergingPress.merge on float64 tensors, its kept indices in a shuffled (topk-like) order."""
    press = kvpress.MergingPress(press=kvpress.KnormPress(compression_ratio=0.5), similarity_threshold=threshold,
                                 merge_fraction=fraction)
    H, n, d = 3, 60, 32
    k = rng.standard_normal((H, n, d)).astype(np.float32)
    v = rng.standard_normal((H, n, d)).astype(np.float32)
    keep = [np.sort(rng.choice(n, 25, replace=False)) for _ in range(H)]
    idx = torch.from_numpy(np.stack([rng.permutation(kk) for kk in keep]))[None]
    _, vals = press.merge(torch.from_numpy(k)[None].double(), torch.from_numpy(v)[None].double(), idx)
    for h in range(H):
        theirs = vals[0, h, keep[h]].numpy()
        assert rel(capi.merge_similar(k[h], v[h], keep[h], threshold, fraction), theirs) < RTOL


@pytest.mark.parametrize("budget", [2, 32])
def test_cam_merge_matches_kvpress(rng, budget):
    """kvpress CAMPress.compress with its base press's scores given and torch.bernoulli replaced by our draws."""
    Hkv, n, d, target, steps, layer = 2, 70, 16, 40, 12, 3
    scores = rng.standard_normal((Hkv, n)).astype(np.float32)
    attn = rng.uniform(0, 1, (Hkv, n)).astype(np.float32)
    v = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    k = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    seed = int(rng.integers(0, 2**63))
    press = kvpress.CAMPress(base_press=kvpress.KnormPress(), target_size=target, merge_budget=budget)
    press.base_press.score = lambda *a, **kw: torch.from_numpy(scores)[None].double()
    press.layer_step_counts[layer] = steps
    press._running_attn_sum[layer] = torch.from_numpy(attn)[None].double()

    def bernoulli(p):
        return torch.from_numpy((cam_uniforms(seed, layer, 0, Hkv, p.shape[-1]) < p[0].numpy()).astype(np.float64))[None]

    with mock.patch.object(torch, "bernoulli", bernoulli):
        keys, vals = press.compress(SimpleNamespace(layer_idx=layer), None, torch.from_numpy(k)[None].double(),
                                    torch.from_numpy(v)[None].double(), torch.from_numpy(attn)[None].double(), {})
    keep, out = capi.cam_merge(scores, attn, v, target, steps, budget, seed, layer, 0)
    assert np.allclose(keys[0].numpy(), k[:, keep])  # the same rows kept, in position order
    assert rel(out, vals[0].numpy()) < RTOL
    assert rel(out, v[:, keep]) > 1e-3, "nothing was merged"


# -- the session path ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from random_llama import write_random_llama
    path = write_random_llama(str(tmp_path_factory.mktemp("merge")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)
    return kvpress_c.load_model(path)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_session_merge_equals_reference(tiny_model, rng, ratio):
    """The kept rows' values after a MergingPress prefill = the reference merge of the full prefill's rows."""
    ids = rng.integers(3, 300, 90).astype(np.int32)
    full = tiny_model.new_session()
    full.forward(ids, logits="last")
    press = kvpress_c.MergingPress(kvpress_c.KnormPress(compression_ratio=ratio))
    s = tiny_model.new_session()
    s.set_press(**press.c_config())
    s.forward(ids, logits="last")
    merged_any = False
    for layer in range(tiny_model.config["n_layers"]):
        for h in range(tiny_model.config["n_kv_heads"]):
            keep = s.cache_positions(layer, h)
            k, v = full.cache_rows(layer, h)
            want = merge_similar(k, v, keep)
            got_k, got_v = s.cache_rows(layer, h)
            assert np.array_equal(got_k, k[keep]), "keys are kept as they are"
            assert rel(got_v, want) < RTOL
            merged_any |= rel(got_v, v[keep]) > 1e-3
    assert merged_any


def test_bad_merge_settings_are_clear_errors(tiny_model):
    with pytest.raises(ValueError, match="ScorerPress"):
        kvpress_c.MergingPress(kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5)))
    with pytest.raises(ValueError, match="similarity_threshold"):
        kvpress_c.MergingPress(kvpress_c.KnormPress(compression_ratio=0.5), similarity_threshold=1.5)
    with pytest.raises(ValueError, match="merge_fraction"):
        kvpress_c.MergingPress(kvpress_c.KnormPress(compression_ratio=0.5), merge_fraction=0.0)
    with pytest.raises(ValueError, match="merge_budget"):
        kvpress_c.CAMPress(kvpress_c.KnormPress(), merge_budget=0)
    with pytest.raises(ValueError, match="plain scorer press"):
        kvpress_c.CAMPress(kvpress_c.AdaKVPress(kvpress_c.KnormPress()))
    # CaM shares one selection across a layer's heads: after a per-head (Ada-KV) prefill the heads hold different
    # row counts, and the decoding press says so at its first step
    s = tiny_model.new_session()
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=4)).c_config())
    s.set_decoding_press(**kvpress_c.CAMPress(kvpress_c.KnormPress(), target_size=8).decoding_config())
    s.forward(np.arange(3, 80, dtype=np.int32), logits="last")
    if (s.cache_lengths() == s.cache_lengths()[:, :1]).all():
        pytest.skip("Ada-KV kept equal head lengths on this prompt")
    with pytest.raises(NotImplementedError, match="same number of rows"):
        s.forward(np.array([5], np.int32))
