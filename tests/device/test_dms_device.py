"""DMSPress on a device against the CPU and against the float64 reference of its schedule: the same prompt and
decoded tokens on both (teacher forcing); each device's kept rows must be the reference's for the Knorm scores
of its own keys (read back from its cache), and the two devices keep nearly the same rows (bf16 keys move a
score across the threshold now and then)."""
from __future__ import annotations

import numpy as np
import pytest

import kvpress_c
from dms_reference import dms_reference, knorm
from random_llama import write_random_llama


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("dms_dev")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)


def run(model, press, prompt, steps):
    """Kept positions [L][Hkv] and, per (layer, head), the Knorm score of every row in call order."""
    cfg = model.config
    L, Hkv = cfg["n_layers"], cfg["n_kv_heads"]
    full = model.new_session()
    full.forward(prompt, logits="last")
    calls = [[[knorm(full.cache_rows(l, h)[0])] for h in range(Hkv)] for l in range(L)]
    s = model.new_session()
    s.set_press(**press.c_config())
    s.set_decoding_press(**press.decoding_config())
    s.forward(prompt, logits="last")
    for t in steps:
        s.forward(np.array([t], np.int32), logits="last")
        for l in range(L):
            for h in range(Hkv):
                calls[l][h].append(knorm(s.cache_rows(l, h)[0][-1:]))
    return [[s.cache_positions(l, h) for h in range(Hkv)] for l in range(L)], calls, s


def test_dms_matches_reference_and_cpu(model_path, device, rng):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    prompt = rng.integers(3, 300, 90).astype(np.int32)
    steps = rng.integers(3, 300, 20).astype(np.int32)
    full = cpu.new_session()
    full.forward(prompt, logits="last")
    threshold = float(np.median(knorm(full.cache_rows(1, 0)[0])))
    press = kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=threshold, sliding_window_size=8, decoding=True)
    kept = {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        rows, calls, s = run(m, press, prompt, steps)
        kept[name] = rows
        for l, row in enumerate(rows):
            for h, got in enumerate(row):
                want = dms_reference(calls[l][h], 8, threshold)
                every = np.concatenate(calls[l][h])
                # our fp32 norms of the stored keys against float64 ones: a row this close to the threshold may go
                # either way (measured over 8 seeds: no differing row at all)
                for r in set(got.tolist()) ^ set(want):
                    assert abs(every[r] - threshold) <= 1e-5 * abs(threshold), (name, l, h, r)
        assert s.cache_bytes <= s.peak_cache_bytes
    js = [len(set(a.tolist()) & set(b.tolist())) / len(set(a.tolist()) | set(b.tolist()))
          for la, lb in zip(kept["cpu"], kept["dev"]) for a, b in zip(la, lb)]
    print(f"DMSPress on {device}: mean Jaccard with the CPU {np.mean(js):.3f}")
    # bf16 keys move Knorm scores by ~0.4 %: rows near the threshold flip (measured mean >= 0.95)
    assert np.mean(js) > 0.9, js
