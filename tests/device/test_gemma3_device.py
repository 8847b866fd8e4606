"""Gemma 3 and Gemma 2 on a device (the emulated one always, CUDA where present) against the CPU: the sliding and
full layers, each on its RoPE, the post-attention and post-MLP norms (head_rmsnorm over the whole row), GeGLU,
the embedding scale and Gemma 2's soft-capping through the backend table; prefill, then decode steps on the
device cache (eager and as a decode graph)."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvpress_c  # noqa: E402
from gemma3_models import write_tiny_gemma3  # noqa: E402

# max |device - cpu| / max |cpu| of the logits: bf16 weights, activations and cache against fp32. Measured on
# the emulated device (120-token prefill, 10 decode steps): Gemma 3 over 11 seeds, prefill 0.013 .. 0.021, decode
# steps up to 0.022; Gemma 2 (q_proj x 3: sharper attention, soft-capped) over 10 seeds, prefill 0.018 .. 0.029,
# decode steps up to 0.031. The bound is 1.5x the largest.
TOL = {"gemma3": 1.5 * 0.022, "gemma2": 1.5 * 0.031}


def rel(a, ref):
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])  # Gemma 2: its soft-capped attention scores and logits too
def test_gemma_logits_prefill_and_decode_match_cpu(tmp_path, rng, device, family):
    from gemma2_models import write_tiny_gemma2
    seed = int(rng.integers(1 << 31))
    path = (write_tiny_gemma3 if family == "gemma3" else write_tiny_gemma2)(str(tmp_path / family), seed=seed)
    cpu, dev = kvpress_c.load_model(path), kvpress_c.load_model(path, device=device)
    ids = rng.integers(3, 256, size=130).astype(np.int32)
    err = [rel(dev.logits(ids[:120]), cpu.logits(ids[:120]).astype(np.float64))]
    sc, sd = cpu.new_session(), dev.new_session()
    sc.forward(ids[:120], logits="none")
    sd.forward(ids[:120], logits="none")
    for t in ids[120:]:
        err.append(rel(sd.forward(np.array([t], np.int32)), sc.forward(np.array([t], np.int32)).astype(np.float64)))
    print(f"{family} on {device} (seed {seed}): prefill {err[0]:.3g}, decode max {max(err[1:]):.3g}")
    assert max(err) < TOL[family]
    np.testing.assert_array_equal(sd.cache_lengths(), sc.cache_lengths())
