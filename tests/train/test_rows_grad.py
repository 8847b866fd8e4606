"""The shared host forward/backward of rows over a cached prefix (csrc/train/rows_grad.c) on what Judge Q's own tests
do not cover: Qwen3's per-head q/k RMSNorm in the backward (Judge Q's gradient on a tiny qwen3 against float64
central differences) and the models it refuses. KVgrad's objective is tested in tests/press/test_kvgrad.py,
RestoreKV's LoRA forward in tests/press/test_restorekv.py."""
import numpy as np
import pytest

import kvpress_c
from kvpress_c import judgeq
from test_judgeq_train import NpJudgeQ, rel_err


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from hf_models import write_tiny_model
    from np_llama import NpLlama
    path = write_tiny_model(str(tmp_path_factory.mktemp("rows") / "qwen3"), arch="qwen3", seed=7)
    return kvpress_c.load_model(path), NpLlama(path)


def test_judgeq_gradient_with_qk_norm_matches_float64_finite_differences(tiny_qwen3, rng):
    model, ref = tiny_qwen3
    V, D = model.config["vocab"], model.config["hidden"]
    P, nr, m = int(rng.integers(20, 40)), int(rng.integers(3, 9)), 3
    prompt, response = rng.integers(0, V, P), rng.integers(0, V, nr)
    E = (rng.standard_normal((m, D)) * 0.5).astype(np.float32)
    npj = NpJudgeQ(ref, prompt, response)
    E64 = E.astype(np.float64)
    loss, grad = judgeq.loss_and_grad(model, prompt, response, E)
    assert abs(loss - npj.loss(E64)) <= 1e-4 * npj.loss(E64)
    h, fd = 1e-4, np.zeros_like(E64)
    for idx in np.ndindex(E64.shape):
        e = np.zeros_like(E64)
        e[idx] = h
        fd[idx] = (npj.loss(E64 + e) - npj.loss(E64 - e)) / (2 * h)
    norm_err, max_err = rel_err(grad.astype(np.float64), fd)
    print(f"qwen3: Judge Q gradient vs float64 central differences: {norm_err:.2e} (norm), {max_err:.2e} (max)")
    assert norm_err < 1e-4 and max_err < 1e-4  # the same bound as llama's (tests/train/test_judgeq_train.py)


def test_sliding_window_models_are_refused(tmp_path):
    from hf_models import write_tiny_model
    model = kvpress_c.load_model(write_tiny_model(str(tmp_path / "mistral"), arch="mistral", window=8, seed=1))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        judgeq.loss_and_grad(model, np.arange(3, 23), np.arange(3, 8), np.zeros((2, model.config["hidden"]), np.float32))
