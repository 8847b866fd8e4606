"""kvpress_c.QuantizedCache (KIVI) against transformers' QuantizedCache with the optimum-quanto backend (the PyPI
backend that installs: optimum-quanto 0.2.7, a test dependency in the Makefile; HQQ's quantiser optimises its
scale and zero point instead of taking the min-max ones, so it is no peer of KIVI's codes and is not compared).

What is compared: a tiny random Llama (head_dim 64, fp32, eager attention) run by transformers with
`QuantizedCache(backend="quanto", config, nbits, axis_key=-1, axis_value=0, q_group_size, residual_length)` (quanto's
axis -1: each key channel over groups of q_group_size tokens; axis 0: each value row over groups of q_group_size
channels: KIVI's layout, which kvpress_c keeps) and by kvpress_c from the same folder with
`QuantizedCache(nbits, q_group_size, residual_length)`: a prompt of 2 residual_length tokens (a multiple of the group),
then residual_length + 8 decode steps fed the fp32 cache's greedy tokens (one flush of the residual on the way), the
logits of every decode step.

The two differ by design in two ways: kvpress_c stores each group's scale and minimum in f16 (quanto in f32), and
transformers quantises the whole cache again at each flush (the dequantised blocks with the residual; the blocks'
codes come back the same up to the f32 rounding of their scale) where kvpress_c quantises the residual's blocks
alone. Both quantise a prompt of residual_length tokens or more at the prefill and the residual the step it reaches
residual_length, and both read a call's own rows exact. With quanto's scale and shift rounded to f16 as kvpress_c
stores them, the two agree to the summation order's noise (a K value ~1e-6 apart lands on the other side of a
code's boundary now and then)."""
import contextlib
from unittest import mock

import numpy as np
import pytest

import kvpress_c

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("optimum.quanto")

from hf_models import hf_model, write_tiny_model  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)

# Measured over 16 random prompts per setting (max |a - b| / max |b| over the decode steps):
#   ours ~ quanto with f16 scale and shift: max 7.8e-3 (2-bit), 1.8e-3 (4-bit), typically 1e-4
#   ours ~ quanto as it stores (f32):       0.04 - 0.36
#   ours ~ fp32 cache, quanto ~ fp32 cache: 0.26 - 0.53 (4-bit), 1.1 - 1.7 (2-bit) (a random model's logits move
#   a lot); the ratio of ours ~ quanto to the smaller of those two: at most 0.30
F16_SCALE_BOUND = 3e-2
STOCK_RATIO_BOUND = 0.6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = write_tiny_model(str(tmp_path_factory.mktemp("kivi_parity")), layers=2, vocab=256, shape=SHAPE,
                            with_tokenizer=False)
    return hf_model(path), kvpress_c.load_model(path)


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def quanto_f16(self, tensor, axis):
    """transformers' QuantoQuantizedLayer._quantize with the scale and shift rounded to f16, as kvpress_c stores them."""
    from optimum.quanto import quantize_weight
    scale, shift = self.optimizer(tensor, self.qtype, axis, self.q_group_size)
    return quantize_weight(tensor, self.qtype, axis, scale.half().float(), shift.half().float(), self.q_group_size)


def hf_decode(hf, ids, tokens, nbits, group, residual, f16_scale):
    from transformers.cache_utils import QuantoQuantizedLayer
    cache = transformers.QuantizedCache(backend="quanto", config=hf.config, nbits=nbits, axis_key=-1, axis_value=0,
                                        q_group_size=group, residual_length=residual)
    patch = mock.patch.object(QuantoQuantizedLayer, "_quantize", quanto_f16) if f16_scale else contextlib.nullcontext()
    out = []
    with patch, torch.no_grad():
        hf(torch.tensor([ids.tolist()]), past_key_values=cache, use_cache=True)
        for t in tokens:
            out.append(hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1].double().numpy())
    return out


@pytest.mark.parametrize("nbits,group,residual", [(4, 32, 64), (2, 16, 32)])
def test_decode_logits_against_transformers_quantized_cache(models, rng, nbits, group, residual):
    hf, ours = models
    ids = rng.integers(3, 256, 2 * residual).astype(np.int32)
    f32 = ours.new_session(kv_cache="f32")
    logits = f32.forward(ids)
    tokens, want = [], []
    for _ in range(residual + 8):
        tokens.append(int(np.argmax(logits)))
        logits = f32.forward(np.array([tokens[-1]], np.int32))
        want.append(logits.astype(np.float64))
    s = ours.new_session(kv_cache=kvpress_c.QuantizedCache(nbits, group, residual))
    s.forward(ids)
    mine = [s.forward(np.array([t], np.int32)) for t in tokens]
    theirs16 = hf_decode(hf, ids, tokens, nbits, group, residual, f16_scale=True)
    theirs = hf_decode(hf, ids, tokens, nbits, group, residual, f16_scale=False)
    e16 = max(rel(a, b) for a, b in zip(mine, theirs16))
    e = max(rel(a, b) for a, b in zip(mine, theirs))
    e_ours = max(rel(a, b) for a, b in zip(mine, want))
    e_theirs = max(rel(a, b) for a, b in zip(theirs, want))
    print(f"{nbits}-bit g{group} r{residual}: ours~quanto(f16 scale) {e16:.1e}, ours~quanto {e:.1e}, "
          f"ours~fp32 {e_ours:.1e}, quanto~fp32 {e_theirs:.1e}")
    assert e16 < F16_SCALE_BOUND
    assert e < STOCK_RATIO_BOUND * min(e_ours, e_theirs)
    assert e_ours > 10 * e16, "the quantisation shows: the comparison is not between two fp32 caches"
