"""KVComposePress on a device against the CPU: the whole press (full prefill, the context replayed on its own
cache, the statistics on the host from the device's rows and queries, the allocation, the compaction)."""
from __future__ import annotations

import numpy as np
import pytest

import kvpress_c
from random_llama import write_random_llama


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("kvcompose_dev")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)


@pytest.mark.parametrize("structured", [True, False])
def test_kvcompose_matches_cpu(model_path, device, rng, structured):
    cpu, dev = kvpress_c.load_model(model_path), kvpress_c.load_model(model_path, device=device)
    ids = rng.integers(3, 300, 120).astype(np.int32)
    kept = {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        s = m.new_session()
        kvpress_c.KVComposePress(structured=structured, compression_ratio=0.6).prefill(s, ids, m.config)
        kept[name] = [[set(s.cache_positions(l, h).tolist()) for h in range(m.config["n_kv_heads"])]
                      for l in range(m.config["n_layers"])]
        assert s.position == len(ids) and s.cache_bytes <= s.peak_cache_bytes
    total = [sum(len(a) for la in kept[x] for a in la) for x in ("cpu", "dev")]
    js = [len(a & b) / len(a | b) for la, lb in zip(kept["cpu"], kept["dev"]) for a, b in zip(la, lb)]
    print(f"KVCompose(structured={structured}) on {device}: kept {total}, mean Jaccard {np.mean(js):.3f}")
    # the same total (the counts follow the share of all entries); bf16 attention moves near-ties of the
    # statistics and so a few rows or a count between layers (measured over 5 seeds: mean Jaccard >= 0.968)
    assert abs(total[0] - total[1]) <= 0.02 * total[0] + 2
    assert np.mean(js) > 0.85, js
