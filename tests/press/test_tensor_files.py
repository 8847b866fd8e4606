"""The NumPy-only safetensors / .npz reader every press that reads local files uses (kvpress_c/presses/_tensor_files.py):
values equal the `safetensors` package's for each dtype, bf16 widened exactly; corrupt or truncated files raise
ValueError (never a crash); the presses' loaders work without the `safetensors` package (a base install lacks it)."""
import os
import sys

import numpy as np
import pytest

from kvpress_c.presses._tensor_files import read_safetensors, read_tensors, write_safetensors


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_values_equal_the_safetensors_package(tmp_path, rng, dtype):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    t = {"a": torch.tensor(rng.normal(size=(3, 5)), dtype=getattr(torch, dtype)),
         "b.c": torch.tensor(rng.normal(size=(7,)), dtype=getattr(torch, dtype))}
    path = str(tmp_path / "t.safetensors")
    save_file(t, path)
    got = read_safetensors(path)
    assert sorted(got) == ["a", "b.c"]
    for k, v in t.items():
        np.testing.assert_array_equal(np.asarray(got[k], np.float64), v.double().numpy())  # exact: widening only


def test_writer_round_trip_and_npz(tmp_path, rng):
    x = {"w": rng.normal(size=(4, 6)).astype(np.float32), "v": rng.normal(size=(2,)).astype(np.float32)}
    write_safetensors(str(tmp_path / "x.safetensors"), x, metadata={"k": 1})
    np.savez(tmp_path / "x.npz", **x)
    for name in ("x.safetensors", "x.npz"):
        got = read_tensors(str(tmp_path / name))
        for k in x:
            np.testing.assert_array_equal(got[k], x[k])


def test_corrupt_and_truncated_files_raise_value_error(tmp_path, rng):
    """Every truncation and a few hundred random byte corruptions of a valid file: a ValueError or a file that
    still parses to arrays of the declared shapes, never another exception."""
    path = str(tmp_path / "ok.safetensors")
    write_safetensors(path, {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))})
    raw = open(path, "rb").read()
    bad = str(tmp_path / "bad.safetensors")
    cases = [raw[:n] for n in range(0, len(raw), 3)]
    for _ in range(300):
        b = bytearray(raw)
        for i in rng.integers(0, len(b), rng.integers(1, 6)):
            b[i] = int(rng.integers(0, 256))
        cases.append(bytes(b))
    for data in cases:
        with open(bad, "wb") as f:
            f.write(data)
        try:
            out = read_safetensors(bad)
        except ValueError:
            continue
        assert all(isinstance(v, np.ndarray) for v in out.values())


def test_loaders_work_without_the_safetensors_package(tmp_path, rng, monkeypatch):
    from kvpress_c.presses.judgeq import load_soft_embeddings
    from kvpress_c.presses.qfilter import load_q_filters
    f = rng.normal(size=(2, 3, 8)).astype(np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), {"q_filters": f})
    write_safetensors(str(tmp_path / "soft.safetensors"), {"soft_embeddings": f[0]})
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    np.testing.assert_array_equal(load_q_filters(str(tmp_path)), f)
    np.testing.assert_array_equal(load_soft_embeddings(str(tmp_path / "soft.safetensors")), f[0])
