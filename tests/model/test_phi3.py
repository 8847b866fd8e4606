"""Phi-3 / Phi-3.5 / Phi-4-mini against HF transformers' Phi3ForCausalLM in fp32 on tiny random models the test
writes: fused qkv_proj / gate_up_proj, a partial rotary factor (Phi-4-mini), LongRoPE with prompts before and
past the original context (short and long factors, the attention factor), greedy continuations, a decode that
crosses the original context over the cache, and the same model as a GGUF file with llama.cpp's 'phi3' names."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import kvpress_c  # noqa: E402
from phi3_models import ORIGINAL_CONTEXT, write_phi3_gguf, write_tiny_phi3  # noqa: E402
from hf_models import hf_logits, hf_model, rel_err  # noqa: E402

# measured: fp32 against HF eager on these tiny models, max |ours - HF| / max |HF| over every logit,
# 6.6e-7 .. 8.9e-7 (40- and 300-token prompts, partial 1.0 and 0.5, LongRoPE): the bound
TOL = 1e-5

# (partial rotary factor, LongRoPE): Phi-3-mini-128k / Phi-3.5 (whole head, LongRoPE), Phi-4-mini (0.75 of the
# head, LongRoPE: 12 of 16 dims here), Phi-3-mini-4k (no scaling), a half-head rotary without scaling
CASES = [(1.0, True), (0.75, True), (1.0, False), (0.5, False)]


@pytest.fixture(params=CASES, ids=lambda c: f"partial{c[0]}-{'longrope' if c[1] else 'plain'}")
def phi3(request, tmp_path_factory, rng):
    partial, longrope = request.param
    seed = int(rng.integers(1 << 31))
    print(f"seed {seed}")
    path = write_tiny_phi3(str(tmp_path_factory.mktemp("phi3")), seed=seed, partial=partial, longrope=longrope)
    return path, partial, longrope, seed


def test_config(phi3):
    path, partial, longrope, _ = phi3
    c = kvpress_c.load_model(path).config
    assert c["arch"] == "phi3" and c["head_dim"] == 16 and c["rope_dim"] == int(16 * partial)
    assert c["rope_long_context"] == (ORIGINAL_CONTEXT if longrope else 0)
    # transformers' default attention factor: sqrt(1 + ln(512 / 64) / ln 64)
    assert c["rope_attn_factor"] == pytest.approx(np.sqrt(1 + np.log(8) / np.log(64)) if longrope else 1.0, rel=1e-6)


@pytest.mark.parametrize("n", [40, 300])  # before and past the original context (64): short, then long factors
def test_logits_match_hf(phi3, rng, n):
    path, partial, longrope, seed = phi3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    ids = rng.integers(3, 256, size=n).tolist()
    ref = hf_logits(hf, ids)
    err = rel_err(model.logits(ids), ref)
    print(f"partial {partial} longrope {longrope} n {n} (seed {seed}): max relative logit error {err:.2e}")
    assert err < TOL
    gg = kvpress_c.load_model(write_phi3_gguf(path, path + "/model.gguf"), weights="fp32")
    assert gg.config["rope_dim"] == model.config["rope_dim"]
    assert gg.config["rope_attn_factor"] == pytest.approx(model.config["rope_attn_factor"], rel=1e-6)
    err = rel_err(gg.logits(ids), ref)
    print(f"  the same model as GGUF: {err:.2e}")
    assert err < TOL


def test_decode_across_the_original_context_matches_hf_cache(phi3, rng):
    """A prefill of 50 (short factors), then one token at a time to 80: from the step whose position + 1 passes 64,
    the new token's q and k turn with the long factors while the cached keys keep theirs, as in transformers'
    cached generation (its rotary update looks at the call's positions only)."""
    path, partial, longrope, seed = phi3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    ids = rng.integers(3, 256, size=80).tolist()
    ref = []
    with torch.no_grad():
        out = hf(torch.tensor([ids[:50]]), use_cache=True)
        ref.append(out.logits[0].double().numpy())
        cache = out.past_key_values
        for t in ids[50:]:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref.append(out.logits[0].double().numpy())
    s = model.new_session()
    ours = [s.forward(ids[:50], logits="all")] + [s.forward([t])[None] for t in ids[50:]]
    err = rel_err(np.concatenate(ours), np.concatenate(ref))
    print(f"partial {partial} longrope {longrope} (seed {seed}): prefill + 30 decode steps {err:.2e}")
    assert err < TOL
    if longrope:  # the cached path differs from one prefill of all 80 (short keys kept), and we follow it
        assert rel_err(model.logits(ids)[50:], np.concatenate(ref)[50:]) > 10 * TOL


def hf_cached_logits(hf, prompt, tokens):
    """HF's logits for the prompt's last row and after each of `tokens`, fed one at a time over its cache (the
    path generate takes: past the original context, only the new tokens turn with the long factors)."""
    rows = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        rows.append(out.logits[0, -1].double().numpy())
        for t in tokens:
            out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1].double().numpy())
    return rows


# before the original context all the way (20 + 16 < 64), and past it from the prompt on (300). A run that
# crosses it differs by design: transformers' Phi-3 generate drops its cache at the first step past the original
# context and prefills the whole sequence again with the long factors; a kvpress_c session (whose cache a press
# may have compressed) keeps its keys and turns only the new ones with the long factors, which is transformers'
# forward over its cache (test_decode_across_the_original_context_matches_hf_cache).
@pytest.mark.parametrize("n", [20, 300])
def test_greedy_matches_hf(phi3, rng, n):
    path, partial, longrope, seed = phi3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    prompt = rng.integers(3, 256, size=n).tolist()
    ours = model.generate(prompt, max_new_tokens=16, stop_ids=[])
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    # every token we pick is HF's argmax on the same prefix over its cache, up to fp32 near ties (1e-5 of the
    # row's scale); without a near tie on the way the two runs are equal
    rows = hf_cached_logits(hf, prompt, ours)
    for step, tok in enumerate(ours):
        row = rows[step]
        assert row[tok] >= row.max() - 1e-5 * np.abs(row).max(), f"step {step}: ours {ours} vs HF {ref} (seed {seed})"
    near_tie = any(np.sort(r)[-1] - np.sort(r)[-2] < 1e-5 * np.abs(r).max() for r in rows)
    assert ours == ref or near_tie, f"ours {ours} vs HF {ref} (seed {seed})"


def test_native_f16_gguf(phi3, rng):
    """F16 matrices in their file's type (the fused and permuted tensors are copied, not mapped): the
    fp32-converted load and the native one agree with each other and with HF to F16's rounding."""
    path, partial, longrope, seed = phi3
    g = write_phi3_gguf(path, path + "/model_f16.gguf", weight_type="F16")
    native, fp32 = kvpress_c.load_model(g), kvpress_c.load_model(g, weights="fp32")
    assert native.config["native_matrices"] > 0
    ids = rng.integers(3, 256, size=100).tolist()
    ref = hf_logits(hf_model(path), ids)
    a, b = native.logits(ids), fp32.logits(ids)
    # measured: F16 weights against HF's fp32 ones ~1e-3; native against fp32-converted ~1e-3 (int8 activations)
    assert rel_err(b, ref) < 1e-2 and rel_err(a, b.astype(np.float64)) < 2e-2


PHI3_KEYS = ["partial_rotary_factor", "rope_scaling", "rope_parameters", "original_max_position_embeddings",
             "max_position_embeddings", "sliding_window", "rope_theta", "head_dim", "tie_word_embeddings", "hidden_act",
             "num_key_value_heads", "intermediate_size"]


def test_fuzz_phi3_configs_never_crash(tmp_path, rng):
    """Random values in Phi-3's own config keys (LongRoPE's lists and factors included): every one loads or is refused
    with a message (support/fuzz.py, a subprocess)."""
    from fuzz import CONFIG_VALUES, run_config_fuzz
    seed = int(rng.integers(1 << 30))
    folder = write_tiny_phi3(str(tmp_path / "phi3"), seed=seed)
    values = CONFIG_VALUES + [0.75, 0.3, {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
                              {"rope_type": "longrope", "short_factor": [1.0], "long_factor": "x"}, {"type": "su"},
                              {"rope_type": "yarn", "factor": 4.0}, {"rope_type": "longrope", "short_factor": [-1.0] * 8,
                                                                     "long_factor": [1e39] * 8}]
    print(run_config_fuzz(tmp_path, folder, PHI3_KEYS, values, seed))


def test_fuzz_phi3_gguf_never_crashes(tmp_path, rng):
    """Corruptions of a 'phi3' GGUF (fused attn_qkv and ffn_up, LongRoPE factor tensors and keys), lies in its own
    phi3.* values included."""
    from fuzz import run_gguf_fuzz
    from gguf_writer import gguf_layout
    seed = int(rng.integers(1 << 30))
    path = write_tiny_phi3(str(tmp_path / "phi3"), seed=seed, layers=2, vocab=64)
    base = write_phi3_gguf(path, str(tmp_path / "base.gguf"))
    print(run_gguf_fuzz(tmp_path, base, gguf_layout(base), seed, n=600, arch="phi3"))
