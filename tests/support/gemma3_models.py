"""Tiny random-weight Gemma 3 text models (transformers' Gemma3ForCausalLM, torch on CPU) for the loader and
forward parity tests: both layer kinds (every PERIOD-th layer full, the others sliding over WINDOW tokens),
each with its own RoPE (linear scaling on the full layers), q/k norms, the four layer norms, GeGLU, and a
query_pre_attn_scalar other than head_dim."""
from __future__ import annotations

import os

# 4 query heads share 2 KV heads of head_dim 16 (hidden 64); 5 layers: sliding, sliding, full, sliding, sliding.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0, query_pre_attn_scalar=24)
LAYERS, PERIOD, WINDOW = 5, 3, 16


def make_config(vocab: int = 256, linear: float = 4.0):
    import transformers

    types = ["full_attention" if (i + 1) % PERIOD == 0 else "sliding_attention" for i in range(LAYERS)]
    rope = {"full_attention": {"rope_type": "linear", "factor": linear, "rope_theta": 1e6} if linear
            else {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return transformers.Gemma3TextConfig(**TINY, num_hidden_layers=LAYERS, vocab_size=vocab, sliding_window=WINDOW,
                                         layer_types=types, rope_parameters=rope, max_position_embeddings=1024,
                                         tie_word_embeddings=True)


def write_tiny_gemma3(path: str, seed: int = 0, **kw) -> str:
    """A Gemma 3 folder at `path` with random weights: matrices std 0.08, norm weights (used as 1 + w) std 0.1."""
    import torch
    import transformers

    from hf_models import write_byte_tokenizer

    cfg = make_config(**kw)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size)
    return path
