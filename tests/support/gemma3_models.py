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


def make_config(vocab: int = 256, linear: float = 4.0, layers: int = LAYERS, period: int = PERIOD, scalar: int = 24,
                hidden: int = 64):
    import transformers

    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    rope = {"full_attention": {"rope_type": "linear", "factor": linear, "rope_theta": 1e6} if linear
            else {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return transformers.Gemma3TextConfig(**{**TINY, "query_pre_attn_scalar": scalar, "hidden_size": hidden}, num_hidden_layers=layers, vocab_size=vocab, sliding_window=WINDOW,
                                         layer_types=types, rope_parameters=rope, max_position_embeddings=1024,
                                         tie_word_embeddings=True)


def write_tiny_gemma3(path: str, seed: int = 0, dtype=None, **kw) -> str:
    """A Gemma 3 folder at `path` with random weights: matrices std 0.08, norm weights (used as 1 + w) std 0.1;
    saved in `dtype` (a torch dtype; None: float32)."""
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
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size)
    return path


# llama.cpp's 'gemma3' fixes what the GGUF cannot say: every 6th layer full, attention scale 1/sqrt(head_dim)
GGUF_SHAPE = dict(layers=7, period=6, scalar=16)


def write_gemma_gguf(hf_dir: str, out: str, weight_type: str = "F32") -> str:
    """The folder's Gemma 3 (made with GGUF_SHAPE) or Gemma 2 model as a GGUF file the way llama.cpp's converters
    write them: arch 'gemma3' or 'gemma2', norms stored as 1 + w, the four layer norms attn_norm,
    post_attention_norm, ffn_norm (pre-MLP), post_ffw_norm; Gemma 3's q/k norms attn_q_norm / attn_k_norm and
    linear RoPE scaling, the soft-capping values the config sets. weight_type: F32 or F16 for the matrices
    (norms stay F32)."""
    import gguf
    import numpy as np
    import torch
    import transformers

    from hf_models import gguf_writer_from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    g2 = c.model_type == "gemma2"
    w = gguf_writer_from_hf(out, "gemma2" if g2 else "gemma3", c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    rope = c.rope_parameters if g2 else c.rope_parameters["full_attention"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if g2 and c.attn_logit_softcapping:  # llama.cpp's gemma3 reads no attention soft-capping, as transformers' runs none
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_token_list([f"<t{i}>".encode() for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    sd = model.state_dict()

    def put(name, t):
        x = t.detach().float().numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            x = x + 1  # llama.cpp's converter: 1 + w
        elif weight_type == "F16":
            x = x.astype(np.float16)
        w.add_tensor(name, x)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    if not g2:
        names.update({"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"})
    for l in range(c.num_hidden_layers):
        for hf, gg in names.items():
            put(f"blk.{l}.{gg}", sd[f"model.layers.{l}.{hf}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_tiny_gemma3_multimodal(text_dir: str, path: str, old_names: bool = False) -> str:
    """The text model of `text_dir` inside a Gemma3ForConditionalGeneration folder (a one-layer vision tower of
    random weights, no image used), as the 4B/12B/27B checkpoints come. old_names: the tensors renamed to the
    layout transformers wrote before 4.52 (language_model.model.*, language_model.lm_head.weight)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from hf_models import write_byte_tokenizer

    text = transformers.Gemma3ForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    cfg = transformers.Gemma3Config(text_config=text.config.to_dict(), mm_tokens_per_image=4,
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=28, patch_size=14))
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.lm_head.weight = mm.model.language_model.embed_tokens.weight
    os.makedirs(path, exist_ok=True)
    mm.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, text.config.vocab_size)
    if old_names:
        f = os.path.join(path, "model.safetensors")
        sd = load_file(f)
        save_file({k.replace("model.language_model.", "language_model.model."): v.contiguous() for k, v in sd.items()}, f,
                  metadata={"format": "pt"})
    return path
