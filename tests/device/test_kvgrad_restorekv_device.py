"""KVgrad and RestoreKV on a device against the CPU. Both run the host forward (and KVgrad's backward) of
train/rows_grad.c in fp32 from the model file's fp32 copy, over the cache the device holds (bf16 there, read with
kv_read); RestoreKV's rows go back into the device's cache through kv_write (rounded to bf16 there)."""
from __future__ import annotations

import numpy as np
import pytest

import kvpress_c
from random_llama import write_random_llama
from restorekv_files import write_restorekv


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("kvgrad_dev")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)


def rel(a, ref):
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def kept_sets(s, cfg):
    return [[set(s.cache_positions(l, h).tolist()) for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]


def mean_jaccard(a, b):
    return float(np.mean([len(x & y) / len(x | y) for la, lb in zip(a, b) for x, y in zip(la, lb)]))


def test_kvgrad_matches_cpu(model_path, device, rng):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    cfg = cpu.config
    ids = rng.integers(3, 300, 160).astype(np.int32)
    rep = np.r_[rng.integers(3, 300, 8), ids[4:160]].astype(np.int32)
    out, kept = {}, {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        s = m.new_session()
        s.forward(ids, logits="none")
        out[name] = s.kvgrad_score(rep, 4, 160, n_sink=4, grad_norms=True)
        assert s.position == len(ids) and (s.cache_lengths() == len(ids)).all()
        full = np.zeros((cfg["n_layers"], cfg["n_kv_heads"], len(ids)), np.float32)
        full[:, :, 4:] = out[name][0]
        s.kvzip_evict(full, 0.7)
        kept[name] = kept_sets(s, cfg)
        assert np.isfinite(s.forward(np.array([5], np.int32), logits="last")).all()
    score_err, norm_err = rel(out["dev"][0], out["cpu"][0]), rel(out["dev"][1], out["cpu"][1])
    jac = mean_jaccard(kept["dev"], kept["cpu"])
    print(f"KVgrad on {device}: scores rel err {score_err:.3g}, gradient norms {norm_err:.3g}, mean Jaccard {jac:.3f}")
    # the context's K/V in bf16 move the reconstruction's attention and gradients (emulated, 300 seeds: scores
    # <= 0.035 (0.048 seen once), norms <= 0.044, Jaccard >= 0.911); the eviction swaps near-ties of the global ranking
    assert score_err < 0.1 and norm_err < 0.08
    assert sum(len(a) for la in kept["dev"] for a in la) == sum(len(a) for la in kept["cpu"] for a in la)
    assert jac > 0.85


def test_restorekv_matches_cpu(model_path, device, rng, tmp_path):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    cfg = cpu.config
    write_restorekv(str(tmp_path), cfg, rng, std=0.1)
    press = kvpress_c.RestoreKVPress(compression_ratio=0.6, adapter_path=str(tmp_path))
    ids = rng.integers(3, 300, 120).astype(np.int32)
    rows, kept = {}, {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        s = m.new_session()
        s.forward(ids, logits="none")
        emb, lora = press.restore_inputs(s.model)
        s.append_embeddings(emb, lora=lora)
        assert s.position == len(ids) + 8 and (s.cache_lengths() == len(ids) + 8).all()
        rows[name] = np.array([s.cache_rows(l, h)[i][len(ids):] for l in range(cfg["n_layers"])
                               for h in range(cfg["n_kv_heads"]) for i in (0, 1)])
        scores = rng.random((cfg["n_layers"], cfg["n_kv_heads"], len(ids))).astype(np.float32) if name == "cpu" else scores
        s.kvzip_evict(scores, min(1.0, 0.6 + 8 / len(ids)))
        kept[name] = kept_sets(s, cfg)
        assert all(set(range(len(ids), len(ids) + 8)) <= k for la in kept[name] for k in la)
        assert np.isfinite(s.forward(np.array([5, 6], np.int32), logits="last")).all()
    err = rel(rows["dev"], rows["cpu"])
    print(f"RestoreKV on {device}: restore K/V rel err {err:.3g}")
    # the context's bf16 K/V under the restore rows' attention, and the rows stored in bf16 (emulated, 300 seeds:
    # <= 0.0165); the same scores evict the same rows
    assert err < 0.03
    assert kept["dev"] == kept["cpu"]
