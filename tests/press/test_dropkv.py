"""DropKVPress (csrc/press/scorers/dropkv.c, kvpress_c/presses/dropkv.py): its scores against a float64 NumPy
reference written from the method's definition (kvpress pull request #285; kvpress 0.5.5 has no DropKV, so
there is no peer to run side by side), the rows it keeps (top k per head, at least the window), its settings,
and a whole prefill on a tiny random llama on the CPU and the emulated device, alone and under Ada-KV, ChunkKV
and DecodingPress. A press new to the project: this file, its C file, its Python file and its README row."""
import numpy as np
import pytest

import kvpress_c
from capi import press_compute, press_config
from method_reference import topk_rows


def dropkv_reference(q, k, v, window, kernel, eps):
    """float64 scores [Hkv, len] of DropKV: q [n, H, d] this call's queries (the cache's last n rows), k, v
    [Hkv, len, d]. For each of the last `window` queries j (row len - window + j, causal) and query head:
    s_r = sum_j (p_jr / (1 - p_jr + eps))^2 ||v_r - o_j||^2, mean over the KV head's query heads,
    avg_pool1d(kernel, padding kernel // 2, zeros counted), the window rows = the head's maximum + 1."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, H, d = q.shape
    Hkv, length, _ = k.shape
    g = H // Hkv
    out = np.zeros((Hkv, length))
    qw = q[n - window:]
    rows = np.arange(length)
    for h in range(Hkv):
        s = np.zeros(length)
        for hq in range(h * g, (h + 1) * g):
            logits = qw[:, hq] @ k[h].T / np.sqrt(d)
            visible = rows[None, :] <= (length - window + np.arange(window))[:, None]
            logits = np.where(visible, logits, -np.inf)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            o = p @ v[h]
            dist = ((v[h][None, :, :] - o[:, None, :]) ** 2).sum(-1)  # [window, len]
            s += ((p / (1 - p + eps)) ** 2 * dist).sum(0)
        s /= g
        pad = np.concatenate([np.zeros(kernel // 2), s, np.zeros(kernel // 2)])
        pooled = np.array([pad[r:r + kernel].sum() / kernel for r in range(length)])
        pooled[length - window:] = pooled.max() + 1
        out[h] = pooled
    return out


def n_kept(length, ratio, window):
    """kvpress DropKVPress: min(len, max(int(len (1 - ratio)), window)) per head."""
    return min(length, max(max(1, int(length * (1 - ratio))), window))


@pytest.mark.parametrize("H,Hkv,length,d,window,kernel,ratio", [(4, 2, 120, 16, 32, 7, 0.5), (6, 3, 257, 32, 16, 5, 0.9),
                                                               (2, 2, 40, 8, 8, 1, 0.7), (8, 2, 64, 16, 32, 7, 0.9)])
def test_dropkv_matches_reference(rng, H, Hkv, length, d, window, kernel, ratio):
    n = window + 1 + int(rng.integers(0, 10))  # the engine needs more prompt rows than the window
    q = rng.standard_normal((n, H, d)) * 1.5  # peaky attention: the p / (1 - p) weights matter
    k, v = rng.standard_normal((Hkv, length, d)), rng.standard_normal((Hkv, length, d))
    cfg = press_config(scorer="dropkv", window=window, kernel=kernel, epsilon=1e-6, compression_ratio=ratio)
    scores, kept = press_compute(cfg, q, k, v)
    ref = dropkv_reference(q, k, v, window, kernel, 1e-6)
    # fp32 probabilities and outputs (GEMMs of length len), squares summed in double: measured max error 6.2e-7 of
    # the head's largest score over these shapes and 40 seeds; asserted 5e-6
    scale = np.abs(ref).max(axis=1, keepdims=True)
    np.testing.assert_allclose(scores / scale, ref / scale, rtol=0, atol=5e-6)
    kk = n_kept(length, ratio, window)
    for h, rows in enumerate(kept):
        assert len(rows) == kk, (h, len(rows), kk)
        want = topk_rows(ref[h], kk)
        cut = np.sort(ref[h])[::-1][kk - 1]
        for r in set(rows.tolist()) ^ set(want.tolist()):  # only near-ties of the cut may differ
            assert abs(ref[h, r] - cut) <= 5e-6 * scale[h, 0], (h, r)
        assert set(range(length - window, length)) <= set(rows.tolist()), "the window is always kept"


def test_dropkv_settings():
    p = kvpress_c.DropKVPress(compression_ratio=0.5)
    assert (p.window_size, p.kernel_size, p.epsilon) == (32, 7, 1e-6)  # the pull request's defaults
    assert "dropkv" in kvpress_c.press_params()["scorer"]["choices"]
    with pytest.raises(ValueError, match="epsilon must be finite and > 0"):
        kvpress_c.DropKVPress(compression_ratio=0.5, epsilon=0.0)
    with pytest.raises(ValueError, match="kernel_size"):
        kvpress_c.DropKVPress(compression_ratio=0.5, kernel_size=4)
    with pytest.raises(ValueError, match="compression_ratio"):
        kvpress_c.DropKVPress(compression_ratio=1.5)
    with pytest.raises(ValueError, match="budget"):  # the window is kept inside a budget
        kvpress_c.DropKVPress(budget=16, window_size=32)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from random_llama import write_random_llama
    return write_random_llama(str(tmp_path_factory.mktemp("dropkv")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)


def kept_rows(session, cfg):
    return [[session.cache_positions(l, h).tolist() for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_dropkv_prefill_keeps_the_reference_rows(tiny_path, rng, device):
    """A compressed prefill keeps, at every layer and head, max(int(n (1 - ratio)), window) rows, the window
    among them, and they are the top rows of the scores the press recorded (on the emulated device too)."""
    model = kvpress_c.load_model(tiny_path, device=device)
    cfg = model.config
    ids = rng.integers(3, 300, 150).astype(np.int32)
    press = kvpress_c.DropKVPress(compression_ratio=0.6, window_size=16, kernel_size=5)
    s = model.new_session()
    s.set_press(**press.c_config())
    s.forward(ids, logits="last")
    got = kept_rows(s, cfg)
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            assert len(got[l][h]) == n_kept(len(ids), 0.6, 16)
            assert set(range(len(ids) - 16, len(ids))) <= set(got[l][h])
    # the same kept rows from the press on its arrays: the full cache's rows and the recorded scores of the press
    s2 = model.new_session()
    s2.set_press(**press.c_config(), record_scores=True)
    s2.forward(ids, logits="last")
    assert kept_rows(s2, cfg) == got
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            sc = s2.press_scores(l, h)
            want = topk_rows(sc, n_kept(len(ids), 0.6, 16))
            assert sorted(want.tolist()) == got[l][h]


@pytest.mark.parametrize("wrap", ["adakv", "chunkkv", "decoding"])
def test_dropkv_under_wrappers(tiny_path, rng, wrap):
    """DropKV composes through the engine's tables like any scorer: Ada-KV's uneven heads, ChunkKV's chunks and
    compression while decoding run it and free rows."""
    model = kvpress_c.load_model(tiny_path)
    cfg = model.config
    ids = rng.integers(3, 300, 160).astype(np.int32)
    inner = kvpress_c.DropKVPress(compression_ratio=0.5, window_size=16)
    s = model.new_session()
    if wrap == "decoding":
        press = kvpress_c.DecodingPress(kvpress_c.DropKVPress(window_size=4), compression_interval=8, target_size=48)
        s.set_decoding_press(**press.decoding_config())
        s.forward(ids, logits="last")
        for t in rng.integers(3, 300, 24):
            s.forward(np.array([t], np.int32), logits="last")
        assert s.decoding_compressions > 0
        lens = [len(s.cache_positions(l, h)) for l in range(cfg["n_layers"]) for h in range(cfg["n_kv_heads"])]
        assert max(lens) <= 48 + 8, lens
        return
    press = kvpress_c.AdaKVPress(inner) if wrap == "adakv" else kvpress_c.ChunkKVPress(inner, chunk_length=8)
    s.set_press(**press.c_config())
    s.forward(ids, logits="last")
    for l in range(cfg["n_layers"]):
        lens = [len(s.cache_positions(l, h)) for h in range(cfg["n_kv_heads"])]
        assert sum(lens) == cfg["n_kv_heads"] * (len(ids) // 2), lens  # half of the layer's rows, over its heads
        if wrap == "chunkkv":
            assert len(set(lens)) == 1  # one chunk selection shared by the heads
