"""Tiny random-weight Hugging Face models written by the tests (llama, mistral, qwen2, Llama-3.1 RoPE)."""
from __future__ import annotations

import os


def write_tiny_model(path: str, arch: str = "llama", dtype: str = "float32", tied: bool = False,
                     sharded: bool = False, seed: int = 0, vocab: int = 256, layers: int = 4) -> str:
    """Write a small GQA model (hidden 64, 4 heads / 2 KV heads, head_dim 16) to `path`; returns path."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if arch in ("llama", "llama31"):
        extra = {}
        if arch == "llama31":
            scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}
            if int(transformers.__version__.split(".")[0]) >= 5:
                extra["rope_parameters"] = dict(scaling, rope_theta=10000.0)
            else:
                extra["rope_scaling"] = scaling
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(rope_theta=10000.0, sliding_window=None, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=10000.0, **common))
        with torch.no_grad():  # non-zero biases so that the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(f"unknown arch {arch}")
    with torch.no_grad():  # larger weights than the default init so logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model = model.to(getattr(torch, dtype))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB" if sharded else "10GB")
    return path
