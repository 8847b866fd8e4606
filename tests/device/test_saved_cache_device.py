"""A saved cache moves between devices: saved on the CPU it loads on the device (rows rounded to the device's
bf16 store, as its own appends round them), saved there it loads back on the CPU exactly, and a cache saved
on the device and reloaded there answers as the session that saved it."""
import numpy as np
import pytest

import kvpress_c
from random_llama import write_random_llama


def bf16(x):
    """float32 -> the nearest bf16 (ties to even), as float32: the device store's rounding."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _rows(s, L, Hkv):
    return [[s.cache_rows(l, h) for h in range(Hkv)] for l in range(L)]


def _compress(model, ids, think):
    """SnapKV over a prompt, then ThinK (freed channels) over a second call: ragged, evicted, pruned."""
    s = model.new_session(0)
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=8)).c_config())
    s.forward(ids[:-16], logits="last")
    s.set_press(**think.c_config())
    think.before_prefill(s, 16, model.config)
    s.forward(ids[-16:], logits="last")
    s.set_press(None)
    return s


@pytest.fixture
def models(tmp_path_factory, device, rng):
    seed = int(rng.integers(1 << 30))
    print("model seed", seed)
    folder = write_random_llama(str(tmp_path_factory.mktemp("m")), layers=2, seed=seed)  # head_dim 64
    return kvpress_c.load_model(folder, weights="fp32"), kvpress_c.load_model(folder, device=device)


def test_cpu_to_device_and_back(models, tmp_path, rng):
    cpu, dev = models
    L, Hkv = cpu.config["n_layers"], cpu.config["n_kv_heads"]
    ids = rng.integers(3, cpu.config["vocab"], 120).astype(np.int32)
    think = kvpress_c.ThinKPress(key_channel_compression_ratio=0.25, window_size=8)
    src = _compress(cpu, ids, think)
    src.save(str(tmp_path / "cpu.kvc"))
    on_dev = dev.new_session(0)
    on_dev.load(str(tmp_path / "cpu.kvc"))
    assert kvpress_c.cache_info(tmp_path / "cpu.kvc")["dtype"] == "F32"
    assert np.array_equal(on_dev.cache_lengths(), src.cache_lengths()) and on_dev.position == src.position
    for l, row in enumerate(_rows(src, L, Hkv)):
        for h, (k, v) in enumerate(row):
            kd, vd = on_dev.cache_rows(l, h)
            assert np.array_equal(kd, bf16(k)) and np.array_equal(vd, bf16(v)), (l, h)
            assert np.array_equal(on_dev.cache_positions(l, h), src.cache_positions(l, h))
    on_dev.save(str(tmp_path / "dev.kvc"))
    assert kvpress_c.cache_info(tmp_path / "dev.kvc")["dtype"] == "BF16"
    back = cpu.new_session(0)
    back.load(str(tmp_path / "dev.kvc"))
    dev_rows = _rows(on_dev, L, Hkv)
    for l, row in enumerate(_rows(back, L, Hkv)):
        for h, (k, v) in enumerate(row):  # bf16 values are f32 values: exact
            assert np.array_equal(k, dev_rows[l][h][0]) and np.array_equal(v, dev_rows[l][h][1]), (l, h)
    ref = cpu.new_session(0)  # arenas sized to the rows held, as a load sizes them
    ref.copy_cache_from(src)
    assert back.cache_bytes == ref.cache_bytes  # ThinK's freed channels came back freed


def test_device_save_reload_answers_the_same(models, tmp_path, rng, device):
    _, dev = models
    ids = rng.integers(3, dev.config["vocab"], 120).astype(np.int32)
    think = kvpress_c.ThinKPress(key_channel_compression_ratio=0.25, window_size=8)
    a = _compress(dev, ids, think)
    a.save(str(tmp_path / "a.kvc"))
    b = dev.new_session(0)
    b.load(str(tmp_path / "a.kvc"))
    q = rng.integers(3, dev.config["vocab"], 6).astype(np.int32)
    la, lb = a.forward(q, logits="all"), b.forward(q, logits="all")
    # the same rows in the same arena layout: the same kernels give the same logits (measured 0.0 on both)
    assert np.abs(la - lb).max() == 0.0
    ta, tb = [], []
    for _ in range(6):
        ta.append(int(np.argmax(la[-1])))
        tb.append(int(np.argmax(lb[-1])))
        la = a.forward(np.asarray([ta[-1]], dtype=np.int32), logits="all")
        lb = b.forward(np.asarray([tb[-1]], dtype=np.int32), logits="all")
    assert ta == tb
