"""Qwen3 (per-head q/k RMSNorm) and sliding-window attention (Mistral, Qwen2/Qwen3 window layers) against
HF transformers in fp32 on tiny random models the test writes, and the window on a compressed cache."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvpress_c  # noqa: E402
from hf_models import hf_logits, hf_model, rel_err, write_tiny_model  # noqa: E402

# measured: fp32 against HF eager on these tiny models, max |ours - HF| / max |HF| over every logit,
# 2e-7 .. 9e-7 over 20 seeds (the llama/qwen2 parity tests use the same 1e-4 bound)
TOL = 1e-4


# (arch, window, first window layer): windows short against the 120-token prompt, so most keys are outside
CASES = [("qwen3", None, 0), ("mistral", 7, 0), ("qwen2", 16, 2), ("qwen3", 5, 1), ("qwen3", 1, 3)]


@pytest.mark.parametrize("arch,window,first", CASES)
def test_logits_match_hf(tmp_path, rng, arch, window, first):
    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(str(tmp_path / arch), arch=arch, seed=seed, window=window, window_layers=first)
    hf, model = hf_model(path), kvpress_c.load_model(path)
    assert model.config["arch"] == arch and model.config["qk_norm"] == (arch == "qwen3")
    assert (model.config["sliding_window"], model.config["window_first_layer"]) == ((window or 0), first if window else 0)
    ids = rng.integers(3, model.config["vocab"], size=120).tolist()
    ref = hf_logits(hf, ids)
    err = rel_err(model.logits(ids), ref)
    print(f"{arch} window={window} from layer {first} (seed {seed}): max relative logit error {err:.2e}")
    assert err < TOL
    # a prefill of 50 then one token at a time: the window starts of each decode step (and of a second
    # multi-token call that straddles the window) come from the cache's positions
    s = model.new_session()
    rows = [s.forward(ids[:50], logits="all")]
    rows.append(s.forward(ids[50:61], logits="all"))
    for t in ids[61:80]:
        rows.append(s.forward([t])[None])
    err = rel_err(np.concatenate(rows), ref[:80])
    assert err < TOL, f"prefill + chunk + decode: {err:.2e} (seed {seed})"


def test_window_reads_positions_not_rows_after_eviction(tmp_path, rng):
    """A compressed cache: StreamingLLM keeps 4 sinks and the 24 most recent rows of a 60-token prompt.
    With a window of 8 the sinks are out of reach, so every later step must give exactly the logits of
    the uncompressed cache; a window counted in rows (not positions) would let the sinks in."""
    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(str(tmp_path / "m"), arch="mistral", seed=seed, window=8)
    model = kvpress_c.load_model(path)
    ids = rng.integers(3, model.config["vocab"], size=80).tolist()
    full, pressed = model.new_session(), model.new_session()
    pressed.set_press(**kvpress_c.StreamingLLMPress(budget=28, n_sink=4).c_config())
    full.forward(ids[:60])
    pressed.forward(ids[:60])
    pressed.set_press(None)
    assert (pressed.cache_lengths() == 28).all()
    assert list(pressed.cache_positions(0, 0)[:5]) == [0, 1, 2, 3, 36]
    for t in ids[60:70]:
        a, b = full.forward([t]), pressed.forward([t])
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")


# GGUF names of a Hugging Face layer's tensors (llama.cpp's converter; qwen3 rows are not permuted)
HF_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def hf_folder_as_gguf(path, out, window=0):
    """The fp32 tensors of a tiny qwen3 folder written as a qwen3 GGUF (window: the file's sliding_window)."""
    import json

    import gguf_writer as gw
    from safetensors.numpy import load_file

    cfg = json.load(open(f"{path}/config.json"))
    tensors = load_file(f"{path}/model.safetensors")
    g = gw.GGUFFile()
    g.str("general.architecture", "qwen3")
    keys = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
            "vocab_size": cfg["vocab_size"]}
    if window:
        keys["attention.sliding_window"] = window
    for k, v in keys.items():
        g.u32(f"qwen3.{k}", v)
    g.add("qwen3.rope.freq_base", gw.F32, float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    g.add("qwen3.attention.layer_norm_rms_epsilon", gw.F32, cfg["rms_norm_eps"])
    for name, x in tensors.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{HF_TO_GGUF[rest.rsplit('.', 1)[0]]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        g.tensor(gname, list(reversed(x.shape)), gw.GGML["F32"][0], np.ascontiguousarray(x, np.float32).tobytes())
    g.write(out)
    return out


@pytest.mark.parametrize("window", [0, 6])
def test_qwen3_gguf_equals_its_hf_folder(tmp_path, rng, window):
    """The same fp32 weights from a qwen3 GGUF and from the HF folder: identical logits (tensor names,
    "neox" RoPE pairs, the q/k norms and the file's sliding window all read the GGUF way)."""
    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(str(tmp_path / "hf"), arch="qwen3", seed=seed, window=window or None, window_layers=0)
    gguf_path = hf_folder_as_gguf(path, str(tmp_path / "m.gguf"), window)
    a, b = kvpress_c.load_model(gguf_path), kvpress_c.load_model(path)
    assert a.config["sliding_window"] == b.config["sliding_window"] == window
    ids = rng.integers(3, b.config["vocab"], size=50).tolist()
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids), err_msg=f"seed {seed}")
