import os
import sys

# quiet the reference libraries (progress bars and warnings would bury the test output)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch and kvpress_c each bring an OpenMP pool; spinning pools on 2 cores starve each other (10 decode
# steps: 17.7 s spinning vs 0.5 s passive under load). Must be set before either runtime starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

# the shared helpers: support/ (the one ctypes binding, model writers) and reference/ (float64 NumPy)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "support"), os.path.join(HERE, "reference")]


def _default_gguf():
    env = os.environ.get("KVC_DEFAULT_GGUF")
    if env and os.path.exists(env):
        return env
    from kvpress_c import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def default_gguf():
    return _default_gguf()


@pytest.fixture(scope="session")
def default_model(default_gguf):
    """The default model in fp32 mode: the reference the parity tests hold to HF / kvpress tolerances
    (native weights quantise decode activations to int8, as llama.cpp does: tests/model/test_native_weights.py)."""
    import kvpress_c
    return kvpress_c.load_model(default_gguf, weights="fp32")


@pytest.fixture(scope="session")
def default_model_native(default_gguf):
    """The default model as load_model gives it: weights in the file's types (Q4_1, Q8_0)."""
    import kvpress_c
    return kvpress_c.load_model(default_gguf)


@pytest.fixture
def rng(request):
    """Fresh randomness each run; the seed is printed on failure (pytest shows captured stdout), and
    KVC_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("KVC_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"[{request.node.name}] numpy seed = {seed}")
    return np.random.default_rng(seed)
