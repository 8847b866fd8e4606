"""Small random-weight Llama folders (config.json + model.safetensors, float32) written with NumPy
alone, for tests that need a model of a given shape (head_dim 64 / 128 for the CUDA kernels)
without torch."""
from __future__ import annotations

import json
import os

import numpy as np


def write_random_llama(path: str, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                       ffn: int = 512, vocab: int = 512, seed: int = 0, rope_theta: float = 500000.0) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for l in range(layers):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:  # std ~ 1/sqrt(fan_in) keeps activations O(1) through the layers; logits far from uniform
            tensors[name] = (rng.standard_normal(shape) * (1.5 / np.sqrt(shape[1]))).astype(np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
           "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd,
           "intermediate_size": ffn, "vocab_size": vocab, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "rope_theta": rope_theta, "tie_word_embeddings": False, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path
