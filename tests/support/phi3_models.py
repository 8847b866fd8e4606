"""Tiny random-weight Phi-3 models (transformers' Phi3ForCausalLM, torch on CPU) for the loader and forward
parity tests: a Hugging Face folder (fused qkv_proj and gate_up_proj, optionally a partial rotary factor
and LongRoPE), and the same weights written as GGUF with llama.cpp's 'phi3' names (the gguf package)."""
from __future__ import annotations

import os

import numpy as np

# 4 query heads share 2 KV heads, head_dim 16 = hidden 64 / 4 heads.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# LongRoPE with a small original context: a 300-token prompt is past it (long factors), a 40-token one is not.
ORIGINAL_CONTEXT = 64
MAX_CONTEXT = 512


def longrope_parameters(rot: int, rng: np.random.Generator, theta: float = 10000.0) -> dict:
    """transformers' rope_parameters for LongRoPE: short factors near 1, long ones growing with the pair index
    (as Phi-3's do), rot / 2 of each."""
    n = rot // 2
    short = (1.0 + 0.05 * rng.random(n)).round(4).tolist()
    long = (1.0 + np.linspace(0, 6, n) * (1 + 0.1 * rng.random(n))).round(4).tolist()
    return {"rope_type": "longrope", "rope_theta": theta, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": ORIGINAL_CONTEXT}


def make_config(layers: int = 3, vocab: int = 256, partial: float = 1.0, longrope: bool = True, seed: int = 0,
                tied: bool = False, window: int | None = None):
    import transformers

    rng = np.random.default_rng(seed)
    rot = int(TINY["hidden_size"] // TINY["num_attention_heads"] * partial)
    rope = longrope_parameters(rot, rng) if longrope else {"rope_type": "default", "rope_theta": 10000.0}
    # top level, as Phi-4-mini's config.json has it
    return transformers.Phi3Config(**TINY, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=tied,
                                   partial_rotary_factor=partial,
                                   max_position_embeddings=MAX_CONTEXT, original_max_position_embeddings=ORIGINAL_CONTEXT,
                                   rope_parameters=rope, sliding_window=window)


def write_tiny_phi3(path: str, seed: int = 0, **kw) -> str:
    """A Phi-3 folder at `path` with random weights (matrices std 0.08, norms around 1), as hf_models does."""
    import torch
    import transformers

    from hf_models import write_byte_tokenizer

    cfg = make_config(seed=seed, **kw)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size)
    return path


def write_phi3_gguf(hf_dir: str, out: str, weight_type: str = "F32") -> str:
    """The folder's model as a GGUF file the way llama.cpp's converter writes Phi-3: arch 'phi3', fused
    blk.N.attn_qkv and blk.N.ffn_up (gate rows, then up), rope_factors_short/long, the original context and
    the attention factor in the metadata. weight_type: F32 or F16 for the matrices."""
    import json

    import gguf
    import torch
    import transformers

    from hf_models import gguf_writer_from_hf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    model = transformers.Phi3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    rp = c.rope_parameters
    rot = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    w = gguf_writer_from_hf(out, "phi3", c)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(rp["rope_theta"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if rp.get("rope_type") == "longrope":
        orig = rp["original_max_position_embeddings"]
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1.0 else float(np.sqrt(1 + np.log(scale) / np.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], dtype=np.float32))
    w.add_token_list([f"<t{i}>".encode() for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)

    def mat(t):
        x = t.detach().float().numpy()
        return x.astype(np.float16) if weight_type == "F16" and x.ndim == 2 else x.astype(np.float32)

    sd = model.state_dict()
    w.add_tensor("token_embd.weight", mat(sd["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", mat(sd["model.norm.weight"]))
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", mat(sd["lm_head.weight"]))
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for l in range(c.num_hidden_layers):
        for hf, gg in names.items():
            w.add_tensor(f"blk.{l}.{gg}", mat(sd[f"model.layers.{l}.{hf}"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
