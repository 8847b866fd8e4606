"""A Python press on a device: `keys` and `values` are host float32 arrays (numpy.from_dlpack gives the same memory)
holding the device's K/V as stored (bf16, widened exactly); `key_rows` / `value_rows` are the store's bf16 rows in
place through DLPack (host memory on the emulated device, the GPU's on CUDA), and scores may come back as a tensor on
the device."""
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvpress_c as K
from kvpress_c import ScorerPress
from random_llama import write_random_llama


@dataclass
class Capture(ScorerPress):
    seen: dict = field(default_factory=dict)
    reads = ("values",)

    def score(self, layer):
        keys = np.from_dlpack(layer.keys)
        assert np.shares_memory(keys, layer.keys) and not keys.flags.writeable
        self.seen[layer.index] = (keys.copy(), np.from_dlpack(layer.values).copy(), layer.device)
        return -np.linalg.norm(keys, axis=-1)


def test_views_are_the_device_rows_through_dlpack(device, tmp_path):
    path = write_random_llama(str(tmp_path / "m"), layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seed=5)
    model = K.load_model(path, device=device)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("prompt seed", seed)
    ids = np.random.default_rng(seed).integers(3, 256, size=80).astype(np.int32)
    full = model.new_session()
    full.forward(ids, logits="none")
    press = Capture(compression_ratio=0.5)
    s = model.new_session()
    s.set_press(**press.c_config())
    s.forward(ids, logits="none")
    for l in range(2):
        keys, values, dev = press.seen[l]
        assert dev == {"emulated": 2, "cuda": 1}[device]
        for h in range(2):
            k, v = full.cache_rows(l, h)
            np.testing.assert_array_equal(keys[h], k)  # the stored rows, bit for bit
            np.testing.assert_array_equal(values[h], v)
        # and what the engine kept is the top half of what the press scored
        want = np.sort(np.argsort(-(-np.linalg.norm(keys, axis=-1)), axis=1, kind="stable")[:, :40], axis=1)
        for h in range(2):
            np.testing.assert_array_equal(s.cache_positions(l, h), want[h])


@dataclass
class DeviceRows(ScorerPress):
    """-||k|| computed by torch on the rows where the device keeps them, returned as a tensor there."""
    seen: dict = field(default_factory=dict)
    reads = ("values",)

    def score(self, layer):
        import torch
        ks = [torch.from_dlpack(r) for r in layer.key_rows]
        vs = [torch.from_dlpack(r) for r in layer.value_rows]
        scores = -torch.stack([torch.linalg.vector_norm(k.double(), dim=-1) for k in ks])
        self.seen[layer.index] = ([k.float().cpu().numpy() for k in ks], [v.float().cpu().numpy() for v in vs],
                                  ks[0].dtype, ks[0].device.type, layer.keys.copy(), scores.float().cpu().numpy(), ks)
        return scores


def test_device_rows_through_dlpack(device, tmp_path):
    torch = pytest.importorskip("torch")
    path = write_random_llama(str(tmp_path / "m"), layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seed=6)
    model = K.load_model(path, device=device)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("prompt seed", seed)
    ids = np.random.default_rng(seed).integers(3, 256, size=80).astype(np.int32)
    full = model.new_session()
    full.forward(ids, logits="none")
    press = DeviceRows(compression_ratio=0.5)
    s = model.new_session()
    s.set_press(**press.c_config())
    s.forward(ids, logits="none")
    for l in range(2):
        keys, values, dtype, where, engine_keys, scores, _ = press.seen[l]
        assert dtype == torch.bfloat16 and where == {"emulated": "cpu", "cuda": "cuda"}[device]
        for h in range(2):
            k, v = full.cache_rows(l, h)
            np.testing.assert_array_equal(keys[h], k)  # the stored rows, bit for bit
            np.testing.assert_array_equal(values[h], v)
            np.testing.assert_array_equal(keys[h], engine_keys[h])
        # the scores (float64 on the device, float32 in the engine) ranked by it: the top half, ties to the lower row
        want = np.argsort(-scores, axis=1, kind="stable")[:, :40]
        for h in range(2):
            np.testing.assert_array_equal(s.cache_positions(l, h), np.sort(want[h]))
    # the tensors the press kept are the rows of its call still, after the store moved on and was freed
    del s
    model.new_session().forward(ids, logits="none")
    for l in range(2):
        keys, held = press.seen[l][0], press.seen[l][6]
        for h in range(2):
            np.testing.assert_array_equal(held[h].float().cpu().numpy(), keys[h])
