"""Host-device traffic of the presses' host work, counted on the emulated device (kvpress_c.device_traffic): it
counts what the CUDA backend moves at each table entry, a copy between host and device memory as a transfer
and a wait for the stream as a sync. Asserted as counts per layer, never as times (speed is benchmarks/').

Each count is the difference between two presses that share every other step (the same top-k and compaction),
so what is left is the part under test:
  - a host scorer's read of the layer's rows: one batched read (the device lengths, then every head's rows:
    two downloads, two waits), where a read per head took two to three each per head;
  - MergingPress's and CAMPress's merged values: one batched read and one batched write per layer, where a
    row-by-row write took an upload and a wait per changed row;
  - CAMPress while decoding: the step's last query and the keys of the rows appended since the last step
    (one row per head), not the whole layer's keys every step.
The results of the same presses are checked against the CPU by test_merging_device.py and tests/press."""
from __future__ import annotations

import math

import numpy as np
import pytest

import kvpress_c
from random_llama import write_random_llama

DEV = "emulated"  # the counts are the CUDA backend's as the emulated device models them; CUDA counts its own
F32 = 4
LAYERS, HEADS, HIDDEN = 2, 4, 128
D = HIDDEN // HEADS


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda k: f"kv{k}")
def model(request, tmp_path_factory):
    path = write_random_llama(str(tmp_path_factory.mktemp(f"traffic{request.param}")), layers=LAYERS, hidden=HIDDEN,
                              heads=HEADS, kv_heads=request.param, ffn=256, vocab=300)
    return kvpress_c.load_model(path, device=DEV)


def prefill_traffic(model, press, ids):
    s = model.new_session()
    s.set_press(**press.c_config())
    kvpress_c.device_traffic(DEV, reset=True)
    s.forward(ids, logits="last")
    return kvpress_c.device_traffic(DEV, reset=True), s


def diff(a, b):
    return {k: a[k] - b[k] for k in a}


def test_traffic_counters_read_and_reset():
    kvpress_c.device_traffic(DEV, reset=True)
    assert set(kvpress_c.device_traffic(DEV)) == {"downloads", "uploads", "syncs", "down_bytes", "up_bytes"}
    assert all(v == 0 for v in kvpress_c.device_traffic(DEV).values())
    with pytest.raises(NotImplementedError, match="no host-device traffic"):
        kvpress_c.device_traffic("cpu")
    with pytest.raises(ValueError):
        kvpress_c.device_traffic("tpu")


def test_host_scorer_reads_a_layer_in_one_transfer(model, rng):
    """KeyDiff (a host scorer: K to the host, scores uploaded per head) against Knorm (scored on the device,
    scores downloaded per head): the same top-k and compaction, so the difference per layer is the rows' read."""
    Hkv, n = model.config["n_kv_heads"], int(rng.integers(60, 140))
    ids = rng.integers(3, 300, n).astype(np.int32)
    host, _ = prefill_traffic(model, kvpress_c.KeyDiffPress(compression_ratio=0.5), ids)
    dev, _ = prefill_traffic(model, kvpress_c.KnormPress(compression_ratio=0.5), ids)
    got = diff(host, dev)
    # per layer: + read (lengths, rows: 2 downloads, 2 waits) + Hkv score uploads (f32 buffers wait for the
    # caller's memory: Hkv waits) - Hkv score downloads (Hkv waits); a read per head took 2 Hkv downloads and waits
    want = {"downloads": LAYERS * (2 - Hkv), "uploads": LAYERS * Hkv, "syncs": LAYERS * 2,
            "down_bytes": LAYERS * (F32 * Hkv + F32 * Hkv * n * D - F32 * Hkv * n), "up_bytes": LAYERS * F32 * Hkv * n}
    print(f"KeyDiff - Knorm on {Hkv} KV heads, {n} rows: {got}")
    assert got == want


def test_observed_attention_reads_the_layer_once_and_the_queries_by_tiles(model, rng):
    """ObservedAttention runs on the host (no device kernel forms every query's whole attention row): the layer's
    keys in one read, the queries in tiles of 128 rows."""
    Hkv, n = model.config["n_kv_heads"], int(rng.integers(130, 300))
    ids = rng.integers(3, 300, n).astype(np.int32)
    obs, _ = prefill_traffic(model, kvpress_c.ObservedAttentionPress(compression_ratio=0.5), ids)
    dev, _ = prefill_traffic(model, kvpress_c.KnormPress(compression_ratio=0.5), ids)
    got = diff(obs, dev)
    tiles = math.ceil(n / 128)
    want = {"downloads": LAYERS * (2 + tiles - Hkv), "uploads": LAYERS * Hkv, "syncs": LAYERS * (2 + tiles)}
    print(f"Observed - Knorm on {Hkv} KV heads, {n} rows: {got}")
    assert {k: got[k] for k in want} == want


def test_merging_reads_and_writes_a_layer_in_one_transfer_each(model, rng):
    """MergingPress(SnapKV) against SnapKV: per layer one batched read of K and V and one batched write of every
    changed kept value (rows and their indices in one upload), whatever the heads and rows."""
    Hkv, n = model.config["n_kv_heads"], int(rng.integers(60, 140))
    ids = rng.integers(3, 300, n).astype(np.int32)
    merged, s = prefill_traffic(model, kvpress_c.MergingPress(kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=8)), ids)
    plain, _ = prefill_traffic(model, kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=8), ids)
    got = diff(merged, plain)
    want = {"downloads": LAYERS * 2, "uploads": LAYERS, "syncs": LAYERS * 3,
            "down_bytes": LAYERS * (F32 * Hkv + 2 * F32 * Hkv * n * D)}
    print(f"MergingPress - SnapKV on {Hkv} KV heads, {n} rows: {got}")
    assert {k: got[k] for k in want} == want
    # the write carries the changed rows with their indices: at most every kept row of every head
    row = F32 * D + 4
    assert got["up_bytes"] % row == 0 and 0 < got["up_bytes"] <= LAYERS * Hkv * (n // 2 + 1) * row, got


def test_cam_decoding_reads_only_the_new_rows(model, rng):
    """CAMPress(StreamingLLM) against DecodingPress(StreamingLLM) while decoding, at steps without a compression:
    each layer's step takes the last query and the keys of this step's row (one per head) in one batched read."""
    Hkv, qd = model.config["n_kv_heads"], HEADS * D
    prompt = rng.integers(3, 300, 90).astype(np.int32)
    steps = rng.integers(3, 300, 5).astype(np.int32)
    per_step = {}
    for name, press in (("cam", kvpress_c.CAMPress(kvpress_c.StreamingLLMPress(), compression_interval=50, target_size=40,
                                                   merge_budget=4, seed=1)),
                        ("plain", kvpress_c.DecodingPress(kvpress_c.StreamingLLMPress(), compression_interval=50,
                                                          target_size=40))):
        s = model.new_session()
        s.set_decoding_press(**press.decoding_config())
        s.forward(prompt, logits="last")
        s.forward(steps[:1], logits="last")  # the first step reads every row held (the prompt's)
        counts = []
        for t in steps[1:]:
            kvpress_c.device_traffic(DEV, reset=True)
            s.forward(np.array([t], np.int32), logits="last")
            counts.append(kvpress_c.device_traffic(DEV, reset=True))
        assert s.decoding_compressions == 0
        per_step[name] = counts
    for cam, plain in zip(per_step["cam"], per_step["plain"]):
        got = diff(cam, plain)
        # per layer: the query (1 download, 1 wait) + the new rows (lengths, rows: 2 downloads, 2 waits); reading
        # the whole layer's keys took 2 downloads and waits per head and every row's bytes every step
        want = {"downloads": LAYERS * 3, "uploads": 0, "syncs": LAYERS * 3,
                "down_bytes": LAYERS * (F32 * qd + F32 * Hkv + F32 * Hkv * D), "up_bytes": 0}
        print(f"CAM - Decoding step on {Hkv} KV heads: {got}")
        assert got == want
