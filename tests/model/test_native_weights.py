"""Native weights (load_model(weights="native"), the default): matrices stay in the file's type on the CPU.

- Prefill of more than a few tokens runs the blocked GEMM, which decodes the weights in its packing step
  to the same fp32 values the fp32 mode holds, then the same microkernel: logits equal fp32 mode's to fp32
  rounding (measured: bit-identical on this machine; bound 1e-5 of the largest logit).
- Decode (and prompts of up to 12 tokens) runs the integer GEMV: activations quantised to int8 blocks, as
  llama.cpp does. Logits then differ from fp32 mode by what that quantisation costs; the bounds below are
  measured on the default model (SmolLM2-135M Q4_1) and tiny random models, and the native error is held
  to llama.cpp's own error against the same fp32 reference (llama-cpp-python, logits_all=True).
- Memory: the weights take the file's bytes (plus fp32 norms), Model.memory() reports them.
"""
import os

import numpy as np

from logit_checks import assert_steps_close
import pytest

import kvpress_c
from gguf_writer import tiny_model

QUANT = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q5_1", "token_embd": "Q5_0", "output": "F16"}
KQUANT = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q5_K", "ffn_gate": "Q6_K",
          "ffn_up": "Q6_K", "ffn_down": "Q3_K", "token_embd": "Q2_K", "output": "BF16"}
# K-quants without an integer kernel and a 16-bit float: their rows decode to fp32 in the GEMV (exact)
KDECODE = {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "Q3_K", "ffn_gate": "Q5_K",
           "ffn_up": "Q5_K", "ffn_down": "Q2_K", "token_embd": "Q3_K", "output": "F16"}
# the CPU backend keeps these three in its interleaved layout (groups of 16 rows); vocab 100 leaves 4
# rows of the embedding and lm_head outside the groups
PACKED = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q4_1"}
MIXED_QKV = {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1"}
TINY = {"quant": dict(types=QUANT, tied=False, hidden=64, ffn=128),
        "kquant": dict(types=KQUANT, tied=False, hidden=256, ffn=256, heads=4, kv_heads=2),
        "kdecode": dict(types=KDECODE, tied=False, hidden=256, ffn=256, heads=4, kv_heads=2),
        "mixed_qkv": dict(types=MIXED_QKV, hidden=64, ffn=128),
        "packed": dict(types=PACKED, tied=False, hidden=64, ffn=96, vocab=100)}


def rel(a, b):
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def decode_logits(model, ids):
    s = model.new_session(len(ids))
    return np.stack([s.forward(np.asarray(ids[i:i + 1], np.int32), logits="last").reshape(-1) for i in range(len(ids))])


@pytest.fixture(scope="module", params=list(TINY))
def tiny_pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("native") / f"{request.param}.gguf")
    tiny_model(seed=3, **{"vocab": 96, **TINY[request.param]}).write(path)
    return request.param, kvpress_c.load_model(path), kvpress_c.load_model(path, weights="fp32")


def test_tiny_models_keep_their_types_and_prefill_matches_fp32(tiny_pair, rng):
    name, native, fp32 = tiny_pair
    assert native.config["weights"] == "native" and fp32.config["weights"] == "fp32"
    assert fp32.config["native_matrices"] == 0
    L = native.config["n_layers"]
    # tensors kept in their type: tok, lm_head and per layer q, k, v, o, gate, up, down; mixed_qkv: q (Q4_0),
    # k, v (Q8_0) each keep their own, gate and up stay Q4_1, its other matrices are F32 (nothing to keep)
    assert native.config["native_matrices"] == (5 * L if name == "mixed_qkv" else 2 + 7 * L)
    assert native.config["weight_bytes"] < fp32.config["weight_bytes"]
    ids = rng.integers(0, 96, int(rng.integers(20, 60)))
    a, b = native.logits(ids), fp32.logits(ids)
    assert np.all(np.isfinite(a)) and rel(a, b) < 1e-5


def test_tiny_models_decode_close_to_fp32(tiny_pair, rng):
    """Integer GEMV on every 32-value block type and Q4_K, Q6_K; the other K-quants, F16, BF16 decode rows
    to fp32 (exact)."""
    name, native, fp32 = tiny_pair
    ids = rng.integers(0, 96, 24)
    a, b = decode_logits(native, ids), decode_logits(fp32, ids)
    assert np.all(np.isfinite(a))
    # per step (logit_checks: near-tie steps of the random models allowed): measured max over 5 seeds quant
    # <= 3.3e-2, mixed_qkv <= 1.3e-2, packed <= 2.3e-2, kquant <= 4.3e-2 (int8 activations); kdecode <= 4.0e-6
    # (rows decoded to fp32: only summation order differs; one near-tie step 1.4e-3 seen). Over 20,000 seeds
    # (3,000 for quant, mixed_qkv, packed: never a step beyond) the medians stay under half the bounds
    # (kquant 4.1e-2, kdecode 8.4e-6), and the steps of 24 beyond them are 0-8 for kdecode (4 or more in 16
    # seeds: the default share of 3 failed those) and 0-2 for kquant but one seed of 7: at most 8 allowed
    assert_steps_close(a, b, 2e-5 if name == "kdecode" else 0.1, what=f"{name} decode native vs fp32",
                       outlier_share=8 / 24)


def test_default_model_native_against_fp32_and_llama_cpp(default_model_native, default_model, default_gguf, rng):
    """Decode with int8 activations (ours and llama.cpp's) against the fp32 model's logits, over 4 random prompts
    of 48 tokens. One prompt is too few: on some contexts a step is ill-conditioned for int8 activations and
    either engine's error there is chance (seed 5022: step 2's mean |diff| ours 27.6, llama.cpp 1.8; on the
    prompt [7406, 23461] ours 4.6 and llama.cpp 6.8; our two GEMV layouts 27.6 and 26.8), and the K/V it writes
    lifts the prompt's later steps. Over 200 prompts (seeds 5000-5199) the per-prompt ratio of our mean error to
    llama.cpp's ran 0.31-3.76 (median 0.97), so a bound on one prompt failed ~1.3% of runs."""
    llama_cpp = pytest.importorskip("llama_cpp")
    n, prompts = 48, 4
    llm = llama_cpp.Llama(model_path=default_gguf, n_ctx=128, n_threads=os.cpu_count(), n_batch=1, n_ubatch=1,
                          logits_all=True, verbose=False)
    err, wrong, top = {"ours": [], "llama.cpp": []}, {"ours": [], "llama.cpp": []}, {"ours": [], "llama.cpp": []}
    for _ in range(prompts):
        ids = rng.integers(100, default_model.config["vocab"] - 100, n).astype(np.int32)
        ref = default_model.logits(ids)  # fp32 mode: dequantised weights, fp32 activations
        # prefill (48 tokens): the blocked GEMM decodes the blocks to the fp32 values
        assert rel(default_model_native.logits(ids), ref) < 1e-5
        # decode: int8 activations against the blocks, token by token
        ours = decode_logits(default_model_native, ids)
        llm.reset()
        for t in ids:
            llm.eval([int(t)])
        theirs = np.asarray(llm.scores[:n], np.float64)
        for name, x in (("ours", ours), ("llama.cpp", theirs)):
            step = np.abs(x - ref).mean(1)  # each step's mean |diff| over the vocabulary
            err[name].append(step)
            wrong[name].append(step > 1.0)  # a step gone wrong (logits of std ~3.7; typical steps 0.1-0.3)
            top[name].append(x.argmax(1) == ref.argmax(1))
    med = {k: float(np.median(np.concatenate(v))) for k, v in err.items()}
    bad = {k: float(np.concatenate(v).mean()) for k, v in wrong.items()}
    top1 = {k: float(np.concatenate(v).mean()) for k, v in top.items()}
    print(f"decode vs fp32 over {prompts} x {n} steps: median step error {med}; steps wrong {bad}; top-1 {top1}")
    # Bounds from the 200 prompts, pooled 4 at a time (20000 draws): the median step error's ratio to llama.cpp's
    # at most 1.43 (p99.9 1.31; one prompt alone up to 1.78); the share of steps gone wrong at most 0.036 above
    # llama.cpp's; llama.cpp's top-1 at most 0.089 above ours. Bounds 1.6, 0.06 and 0.12.
    assert med["ours"] < 1.6 * med["llama.cpp"]
    assert bad["ours"] <= bad["llama.cpp"] + 0.06
    assert top1["ours"] >= top1["llama.cpp"] - 0.12


def test_memory_and_bytes(default_model_native, default_model, default_gguf):
    size = os.path.getsize(default_gguf)
    nat, f32 = default_model_native.config["weight_bytes"], default_model.config["weight_bytes"]
    # the file's blocks plus fp32 norms and RoPE frequencies; fp32 mode holds 4 bytes per parameter
    assert 0.9 * size < nat <= size and f32 > 5 * nat
    mem = default_model_native.memory()
    assert set(mem) == {"weights", "mapped", "cache", "scratch", "rss"} and mem["weights"] == nat
    s = default_model_native.new_session(64)
    s.forward(np.arange(1, 33, dtype=np.int32), logits="last")
    assert default_model_native.memory()["cache"] > 0


def test_weights_argument_errors(default_gguf):
    with pytest.raises(ValueError, match="native"):
        kvpress_c.load_model(default_gguf, weights="int4")


def test_judgeq_gradient_on_native_model(default_model_native, default_model, rng):
    """Judge Q's backward reads fp32 host weights: a native model loads an fp32 copy once, on demand,
    and gives the fp32 model's loss and gradient."""
    from kvpress_c import judgeq
    V = default_model.config["vocab"]
    prompt, response = rng.integers(0, V, 40), rng.integers(0, V, 8)
    E = (0.05 * rng.standard_normal((4, default_model.config["hidden"]))).astype(np.float32)
    l_nat, g_nat = judgeq.loss_and_grad(default_model_native, prompt, response, E)
    l_f32, g_f32 = judgeq.loss_and_grad(default_model, prompt, response, E)
    assert abs(l_nat - l_f32) <= 1e-5 * abs(l_f32)
    assert np.abs(g_nat - g_f32).max() <= 1e-5 * np.abs(g_f32).max()


def test_pipeline_reports_memory(default_model_native):
    from kvpress_c import Pipeline, SnapKVPress
    context = "The quick brown fox jumps over the lazy dog. " * 12
    r = Pipeline(default_model_native)(context, question="What jumps?", press=SnapKVPress(compression_ratio=0.5),
                                       max_new_tokens=4)
    mem = r.stats["memory"]
    assert mem["weights"] == default_model_native.config["weight_bytes"] and mem["rss"] > mem["weights"]
