"""Tiny random-weight Gemma 2 models (transformers' Gemma2ForCausalLM, torch on CPU) for the loader and forward
parity tests: every other layer sliding over WINDOW tokens (from layer 0), one RoPE base, no q/k norms, the four
layer norms, GeGLU, query_pre_attn_scalar, and logit soft-capping of the attention scores and the final logits at
values small enough to act on these weights. (write_gemma_gguf in gemma3_models.py writes them as GGUF 'gemma2'.)"""
from __future__ import annotations

import os

# 4 query heads share 2 KV heads of head_dim 16 (hidden 64); 4 layers: sliding, full, sliding, full.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
LAYERS, WINDOW = 4, 16
# caps that act on these weights: measured on a 70-token prompt (seed 3), removing the attention cap moves the logits
# by 1.7% of their largest (q_proj as drawn) or 17% (q_proj x 3, the default), the final cap by 70% (logits up to 3.1)
ATTN_CAP, FINAL_CAP = 5.0, 2.0


def make_config(vocab: int = 256, layers: int = LAYERS, scalar: int = 24, attn_cap=ATTN_CAP, final_cap=FINAL_CAP):
    import transformers

    return transformers.Gemma2Config(**TINY, num_hidden_layers=layers, vocab_size=vocab, sliding_window=WINDOW,
                                     query_pre_attn_scalar=scalar, attn_logit_softcapping=attn_cap,
                                     final_logit_softcapping=final_cap, max_position_embeddings=1024,
                                     tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def write_tiny_gemma2(path: str, seed: int = 0, q_scale: float = 3.0, **kw) -> str:
    """A Gemma 2 folder at `path` with random weights: matrices std 0.08 (q_proj times q_scale: larger attention
    scores), norm weights (used as 1 + w) std 0.1."""
    import torch
    import transformers

    from hf_models import write_byte_tokenizer

    cfg = make_config(**kw)
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08 * (q_scale if "q_proj" in name else 1.0))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size)
    return path
