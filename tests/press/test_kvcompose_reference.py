"""KVCompose's statistics and allocation (csrc/press/kvcompose.c) against float64 NumPy references
(tests/reference/kvcompose_reference.py) on fresh random inputs: the prompt's attention profile on a float64
NumPy model's queries and keys (cpu and the emulated device), and the eviction of random statistics (exact kept
sets: distinct random values). Parity with kvpress: test_kvcompose.py."""
import numpy as np
import pytest

import kvpress_c
from kvcompose_reference import kvcompose_kept, kvcompose_profile


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hf_models import write_tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("kvcompose_ref") / "llama"), arch="llama", seed=7)


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("total", [False, True])
def test_profile_matches_float64_model(tiny_llama, rng, device, total):
    from np_llama import NpLlama
    n, m = int(rng.integers(40, 100)), int(rng.integers(2, 70))
    ctx, prompt = rng.integers(3, 256, size=n), rng.integers(3, 256, size=m)
    ref = NpLlama(tiny_llama)
    cache = ref.empty_cache()
    ref.forward(ref.embed(ctx), np.arange(n), cache)
    want = []

    def grab(l, q, attn, o, resid, past, cache):
        K = np.stack([cache[l][h]["k"] for h in range(ref.Hkv)])
        want.append(kvcompose_profile(q, K, n, total))

    ref.forward(ref.embed(prompt), n + np.arange(m), cache, hook=grab)
    s = kvpress_c.load_model(tiny_llama, device=device).new_session()
    s.forward(ctx.astype(np.int32), logits="last")
    got = s.kvcompose_profile(prompt.astype(np.int32), sum=total).astype(np.float64)
    assert (s.cache_lengths() == n).all() and s.position == n, "the prompt's rows are dropped"
    err = np.abs(got - np.stack(want)).max() / np.abs(np.stack(want)).max()
    print(f"KVCompose profile {device} sum={total}: rel err {err:.2e}")
    # measured max relative error over 5 seeds: cpu (fp32 engine vs fp64 model) 4.4e-7; emulated (bf16 K/V/q) 2.0e-2
    assert err < (1e-5 if device == "cpu" else 5e-2), err


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("group_max,head_max,add_mean,lower_bound,v_norm",
                         [(False, False, True, 0, False), (True, True, False, 3, True), (False, True, True, 500, False)])
def test_eviction_matches_reference(tiny_llama, rng, device, structured, group_max, head_max, add_mean, lower_bound,
                                    v_norm):
    """Random statistics (distinct values: exact kept sets); ||v|| from the session's own stored values."""
    model = kvpress_c.load_model(tiny_llama, device=device)
    c = model.config
    L, H, Hkv = c["n_layers"], c["n_heads"], c["n_kv_heads"]
    n = int(rng.integers(30, 90))
    ctx = rng.integers(3, 256, size=n).astype(np.int32)
    task = rng.random((L, H, n)).astype(np.float32)
    ratio = float(rng.choice([0.3, 0.5, 0.9]))
    s = model.new_session()
    s.forward(ctx, logits="last")
    vnorm = np.stack([np.stack([np.linalg.norm(s.cache_rows(l, h)[1].astype(np.float64), axis=1) for h in range(Hkv)])
                      for l in range(L)]) if v_norm else None
    s.kvcompose_evict(task, ratio, structured=structured, group_max=group_max, head_max=head_max, add_v_norm=v_norm,
                      add_mean=add_mean, lower_bound=lower_bound)
    want = kvcompose_kept(task.astype(np.float64), Hkv, ratio, structured, group_max, head_max, add_mean, lower_bound,
                          vnorm)
    for l in range(L):
        for h in range(Hkv):
            assert s.cache_positions(l, h).tolist() == want[l][h].tolist(), (l, h)


def test_kvcompose_settings_and_errors(default_model):
    import dataclasses
    kvpress = pytest.importorskip("kvpress")
    theirs = {f.name: f.default for f in dataclasses.fields(kvpress.KVComposePress)}
    ours = {f.name: f.default for f in dataclasses.fields(kvpress_c.KVComposePress) if f.init}
    assert ours == theirs
    with pytest.raises(ValueError, match="agg_task"):
        kvpress_c.KVComposePress(agg_task="median")
    with pytest.raises(ValueError, match="compression_ratio"):
        kvpress_c.KVComposePress(compression_ratio=1.0)
    s = default_model.new_session()
    with pytest.raises(ValueError, match="full cache"):
        s.kvcompose_profile(np.arange(3, 10, dtype=np.int32))
    s.forward(np.arange(3, 40, dtype=np.int32), logits="last")
    with pytest.raises(ValueError, match="shape"):
        s.kvcompose_evict(np.zeros((1, 1, 1), np.float32), 0.5)
