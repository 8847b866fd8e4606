"""The CPU attention over a cache stored in each K/V type reads the rows the store holds, on a random Llama
(head_dim 64) in fp32:
- a fresh session's prefill reads its own rows exact (they wait in f32, read in place): its logits are the
  f32 cache's, bit for bit;
- decode steps (backend/cpu/attention.c's decode path: f16, bf16 and q8_0 tiles read in place by
  backend/cpu/kv_rows_step.c, KIVI tiles by backend/cpu/kv_kivi_step.c when the value groups are whole
  vectors (decoded to f32 by kv_decode.c otherwise), the dequantisation folded into the products: int16
  ones for q8_0 and KIVI on AVX-512 VNNI builds, for q8_0 on AVX2 builds) and a call of 40 tokens over the past (the prefill
  path: the past decoded a tile at a time) against a float64 NumPy forward (tests/reference/np_llama.py)
  given the same past rows, read back from the store with Session.cache_rows (the store's plain decode).
One and two tokens a step; KIVI rows past the last whole group wait in f32 and are read so.
"""
import numpy as np
import pytest

import capi
import kvpress_c
from np_llama import NpLlama
from random_llama import write_random_llama

TYPES = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0",
         "kivi4": kvpress_c.QuantizedCache(4), "kivi2": kvpress_c.QuantizedCache(2),
         "kivi4-g32": kvpress_c.QuantizedCache(4, q_group_size=32, residual_length=40)}
PROMPT = 300


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    seed = int.from_bytes(np.random.default_rng().bytes(4), "little")
    print("model seed", seed)
    folder = write_random_llama(str(tmp_path_factory.mktemp("m")), layers=2, seed=seed)
    return kvpress_c.load_model(folder, weights="fp32"), NpLlama(folder)


@pytest.mark.parametrize("name", list(TYPES))
def test_calls_read_the_stored_rows(model_pair, rng, name):
    model, ref = model_pair
    s = model.new_session(0, kv_cache=TYPES[name])
    ids = rng.integers(0, model.config["vocab"], PROMPT + 46).astype(np.int32)
    first = s.forward(ids[:PROMPT], logits="all")
    f32 = model.new_session(0, kv_cache="f32").forward(ids[:PROMPT], logits="all")
    assert np.array_equal(first, f32)  # the prefill's own rows are read exact
    pos, worst = PROMPT, 0.0
    for n in (1, 2, 1, 2, 40):
        past = [[dict(k=s.cache_rows(l, h)[0].astype(np.float64), v=s.cache_rows(l, h)[1].astype(np.float64),
                      pos=s.cache_positions(l, h)) for h in range(ref.Hkv)] for l in range(ref.L)]
        got = s.forward(ids[pos:pos + n], logits="all")
        want = ref.logits(ref.forward(ref.embed(ids[pos:pos + n]), np.arange(pos, pos + n), past))
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        pos += n
    print(f"{name}: largest difference {worst:.2e} of the largest logit")
    if name in ("kivi4", "kivi2", "q8_0") and capi.step_int16({"q8_0": 3, "kivi4": 4, "kivi2": 5}[name]):
        # int16 products (q s or q, and P s, in steps of 1/32767 of their row's max per tile): measured at
        # most 5.2e-4 (kivi4) and 8.1e-4 (kivi2) over 4 runs, q8_0 2.1e-4 (4 runs; 1.2e-5 with fp32 products);
        # over 1,000 models and prompts since (AVX-512 VNNI): kivi4 at most 1.29e-3, kivi2 1.22e-3, q8_0 3.7e-4
        # (99th percentiles 8.5e-4, 8.9e-4, 2.6e-4); the codes themselves err by 1/15 or 1/3 of a range (KIVI),
        # 1/254 of a block's largest |x| (q8_0)
        assert worst < 2e-3
    else:
        # fp32 against float64 over the same rows: measured at most 1.2e-5 (the f32 cache: 7.4e-6); over 1,000
        # models and prompts at most 1.66e-5 (kivi4-g32; f16 1.62e-5, bf16 1.57e-5, f32 1.33e-5)
        assert worst < 3e-5


@pytest.fixture
def weight_prefetch():
    """Sets the CPU backend's "weight_prefetch" (bytes of the next weights a decode tile of a q8_0 or KIVI cache
    asks for, backend/cpu/weight_hint.h), back to its default of 2048 afterwards."""
    yield lambda n: kvpress_c._core.set_device_option("cpu", "weight_prefetch", n)
    kvpress_c._core.set_device_option("cpu", "weight_prefetch", 2048)


@pytest.mark.parametrize("name", ["f32", "q8_0", "kivi4"])
def test_weight_prefetch_changes_no_result(model_pair, rng, weight_prefetch, name):
    """The layer's next weights fetched during its decode attention (none, the default 2048 bytes a tile, and
    the most, 65536: every byte of the o projection and gate|up) leave every logit as it was, bit for bit."""
    model = model_pair[0]
    ids = rng.integers(0, model.config["vocab"], PROMPT + 6).astype(np.int32)
    runs = []
    for n in (0, 2048, 65536):
        weight_prefetch(n)
        s = model.new_session(0, kv_cache=TYPES[name])
        s.forward(ids[:PROMPT], logits="last")
        runs.append(np.stack([s.forward(ids[p:p + 1], logits="last") for p in range(PROMPT, PROMPT + 6)]))
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


def test_weight_prefetch_setting_refused(weight_prefetch):
    for bad in (-1, 65537):
        with pytest.raises(ValueError, match=r"weight_prefetch.*\[0, 65536\]"):
            weight_prefetch(bad)
    with pytest.raises(ValueError, match="has no setting 'prefetch'.*weight_prefetch"):
        kvpress_c._core.set_device_option("cpu", "prefetch", 1)
