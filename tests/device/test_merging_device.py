"""Value merging on eviction (MergingPress, CAMPress) on a device against the CPU: the merge runs on the rows the
backend gives the host (kv_read), goes back through kv_write and survives the compaction (kv_gather), so the
device path is the CPU's with bf16 storage. Checked: the kept rows agree up to bf16 near-ties, and the merged
values of the device equal the float64 reference merge of the device's own uncompressed rows (MergingPress)
or the CPU's merged values (CAMPress, at its first compression) within bf16 rounding."""
from __future__ import annotations

import numpy as np
import pytest

import kvpress_c
from merge_reference import merge_similar
from random_llama import write_random_llama

BF16 = 2.0 ** -8  # relative rounding of a bf16 store


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("merge_dev")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)


def jaccard(a, b):
    a, b = set(a.tolist()), set(b.tolist())
    return len(a & b) / len(a | b)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_merging_press_matches_cpu(model_path, device, rng, ratio):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    ids = rng.integers(3, 300, 100).astype(np.int32)
    press = kvpress_c.MergingPress(kvpress_c.SnapKVPress(compression_ratio=ratio, window_size=8))
    sessions = {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        s = m.new_session()
        s.set_press(**press.c_config())
        s.forward(ids, logits="last")
        full = m.new_session()
        full.forward(ids, logits="last")
        sessions[name] = (s, full)
    js, swapped, err = [], [], 0.0
    for layer in range(cpu.config["n_layers"]):
        for h in range(cpu.config["n_kv_heads"]):
            kc, kd = (sessions[x][0].cache_positions(layer, h) for x in ("cpu", "dev"))
            js.append(jaccard(kc, kd))
            swapped.append((len(set(kc.tolist()) ^ set(kd.tolist())) // 2, len(kc)))
            s, full = sessions["dev"]
            k, v = full.cache_rows(layer, h)
            want = merge_similar(k, v, kd)
            got = s.cache_rows(layer, h)[1]
            err = max(err, np.abs(got - want).max() / np.abs(want).max())
    # bf16 scores swap near-ties at the cut. Over 300 seeds: at most 3 rows a head of the 50 kept (ratio 0.5; mean
    # Jaccard >= 0.942) and at most 1 of the 9 kept (0.9, where one swap alone is a head's Jaccard 0.8: two such
    # heads of the 4 gave a mean of 0.900 in 4 seeds, e.g. 79429366). The device's merge of its own rows is exact up
    # to the bf16 store of the result (measured <= 3.9e-3 = one bf16 step)
    print(f"MergingPress on {device} at {ratio}: mean Jaccard {np.mean(js):.3f}, rows swapped a head {swapped}, "
          f"merge vs reference {err:.2e}")
    assert all(n <= 1 + k // 12 for n, k in swapped), swapped
    assert np.mean(js) >= 0.85, js
    assert err <= 1.01 * BF16, err


def test_cam_press_matches_cpu(model_path, device, rng):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    press = kvpress_c.CAMPress(kvpress_c.StreamingLLMPress(), compression_interval=6, target_size=40, merge_budget=4, seed=9)
    prompt = rng.integers(3, 300, 80).astype(np.int32)
    steps = rng.integers(3, 300, 6).astype(np.int32)  # up to the first compression: later ones start from its result
    out = {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        s = m.new_session()
        s.set_decoding_press(**press.decoding_config())
        s.forward(prompt, logits="last")
        lengths = []
        for t in steps:  # teacher forcing: the same tokens on both devices
            s.forward(np.array([t], np.int32), logits="last")
            lengths.append(s.cache_lengths())
        out[name] = (s, lengths)
    for a, b in zip(out["cpu"][1], out["dev"][1]):
        np.testing.assert_array_equal(a, b)
    sc, sd = out["cpu"][0], out["dev"][0]
    assert sc.decoding_compressions == sd.decoding_compressions == cpu.config["n_layers"]
    js, errs = [], []
    for layer in range(cpu.config["n_layers"]):
        for h in range(cpu.config["n_kv_heads"]):
            pc, pd = sc.cache_positions(layer, h), sd.cache_positions(layer, h)
            js.append(jaccard(pc, pd))
            if np.array_equal(pc, pd):
                vc, vd = sc.cache_rows(layer, h)[1], sd.cache_rows(layer, h)[1]
                errs.append(np.abs(vc - vd).max() / np.abs(vc).max())
    # StreamingLLM's positional scores: the same rows kept and the same merge candidates on both devices (a
    # scorer of bf16 attention swaps near-ties among the candidates, and every draw after them moves). Values:
    # measured over 10 seeds, layer 0 <= 4.7e-3 (one bf16 step), layer 1 <= 2.2e-2 (bf16 activations through
    # layer 0), and in 1 head of 40 a Bernoulli draw flipped by a bf16-moved probability (0.19: a whole value / m)
    print(f"CAMPress on {device}: mean Jaccard {np.mean(js):.3f}, value rel err per head {np.round(errs, 4)}")
    assert min(js) == 1.0, js
    assert np.median(errs) < 0.03, errs
    assert sd.cache_bytes < sd.peak_cache_bytes
