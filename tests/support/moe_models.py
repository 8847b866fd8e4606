"""Tiny random-weight mixture-of-experts models (transformers' Qwen3MoeForCausalLM and MixtralForCausalLM, torch on
CPU) for the loader and forward parity tests, and the same weights written as GGUF the way llama.cpp's converter
writes them (the gguf package): 'qwen3moe', and Mixtral as 'llama' with expert tensors (q/k rows permuted to
adjacent RoPE pairs). Experts are 3-D tensors there: ffn_gate_exps / ffn_up_exps [E, moe_ffn, hidden],
ffn_down_exps [E, hidden, moe_ffn] (numpy order), the router ffn_gate_inp [E, hidden]."""
from __future__ import annotations

import os

import numpy as np

# 4 query heads share 2 KV heads of head_dim 16 (hidden 64); top-2 of 8 experts of 32; layer 1 a dense MLP of 128.
QWEN3_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                 bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
QWEN3_MOE_LAYERS, QWEN3_MOE_DENSE = 3, [1]
# Mixtral: top-2 of 4 experts of 32 (its intermediate_size), every layer an MoE layer.
MIXTRAL = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               max_position_embeddings=2048)
MIXTRAL_LAYERS = 2
FAMILIES = ("qwen3_moe", "mixtral")


def make_config(family: str, vocab: int = 256, norm_topk: bool = True, dense=None, layers: int | None = None,
                window: int | None = None, **kw):
    import transformers

    if family == "qwen3_moe":
        extra = dict(use_sliding_window=True, sliding_window=window) if window else {}
        return transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **kw}, num_hidden_layers=layers or QWEN3_MOE_LAYERS,
                                           vocab_size=vocab, norm_topk_prob=norm_topk, tie_word_embeddings=False,
                                           mlp_only_layers=QWEN3_MOE_DENSE if dense is None else dense, **extra)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**MIXTRAL, **kw}, num_hidden_layers=layers or MIXTRAL_LAYERS, vocab_size=vocab,
                                          tie_word_embeddings=False, sliding_window=window)
    raise ValueError(f"unknown family {family!r} (one of {FAMILIES})")


def hf_class(family: str):
    import transformers
    return {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}[family]


def write_tiny_moe(path: str, family: str = "qwen3_moe", seed: int = 0, dtype=None, **kw) -> str:
    """A folder at `path` with random weights: matrices (experts and router included) std 0.08, norm weights around 1;
    saved in `dtype` (a torch dtype; None: float32)."""
    import torch

    from hf_models import write_byte_tokenizer

    cfg = make_config(family, **kw)
    torch.manual_seed(seed)
    model = hf_class(family)(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size)
    return path


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for 'llama' files: each head's (i, i + d/2) pairs made adjacent."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(hf_dir: str, out: str, weight_type: str = "F32") -> str:
    """The folder's model as a GGUF file with llama.cpp's converter's names and keys (expert_count,
    expert_used_count, expert_feed_forward_length; expert_weights_norm written only when false, which llama.cpp's
    converter never writes: its qwen3moe files always renormalise). weight_type: F32 or F16 for the matrices
    (norms and the router stay F32, as llama.cpp keeps ffn_gate_inp)."""
    import gguf
    import torch
    import transformers

    from hf_models import gguf_writer_from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    family = c.model_type
    mixtral = family == "mixtral"
    w = gguf_writer_from_hf(out, "llama" if mixtral else "qwen3moe", c)
    hd = c.head_dim
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    E = c.num_local_experts if mixtral else c.num_experts
    w.add_expert_count(E)
    w.add_expert_used_count(c.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if not c.norm_topk_prob:
            w.add_expert_weights_norm(False)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    w.add_token_list([f"<t{i}>".encode() for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name, x, matrix=True):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if matrix and weight_type == "F16":
            x = x.astype(np.float16)
        w.add_tensor(name, x)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"], False)
    put("output.weight", sd["lm_head.weight"])
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    for l in range(c.num_hidden_layers):
        p = f"model.layers.{l}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if mixtral:
            q, k = _permute(q, H), _permute(k, Hkv)
        put(f"blk.{l}.attn_norm.weight", sd[p + "input_layernorm.weight"], False)
        put(f"blk.{l}.attn_q.weight", q)
        put(f"blk.{l}.attn_k.weight", k)
        put(f"blk.{l}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{l}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if not mixtral:
            put(f"blk.{l}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"], False)
            put(f"blk.{l}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"], False)
        put(f"blk.{l}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False)
        moe = p + "mlp."  # transformers 5's module names, whatever the file's
        if moe + "gate.weight" not in sd:  # a dense layer (mlp_only_layers)
            put(f"blk.{l}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
            put(f"blk.{l}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
            put(f"blk.{l}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
            continue
        gate, up, down = experts(sd, moe, E)
        put(f"blk.{l}.ffn_gate_inp.weight", sd[moe + "gate.weight"], False)
        put(f"blk.{l}.ffn_gate_exps.weight", gate)
        put(f"blk.{l}.ffn_up_exps.weight", up)
        put(f"blk.{l}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def experts(sd: dict, moe: str, E: int):
    """(gate [E, Fe, D], up [E, Fe, D], down [E, D, Fe]) from a state dict of transformers 5 (gate_up_proj [E, 2 Fe, D],
    gate rows first, and down_proj) or of the per-expert form (gate_proj/up_proj/down_proj or w1/w3/w2)."""
    if moe + "experts.gate_up_proj" in sd:
        gu, down = sd[moe + "experts.gate_up_proj"], sd[moe + "experts.down_proj"]
        Fe = gu.shape[1] // 2
        return gu[:, :Fe], gu[:, Fe:], down
    names = ("gate_proj", "up_proj", "down_proj") if moe + "experts.0.gate_proj.weight" in sd else ("w1", "w3", "w2")
    return tuple(np.stack([sd[f"{moe}experts.{e}.{n}.weight"] for e in range(E)]) for n in names)


# ---- random-weight GGUF files in the quantised types (no torch): the native-weight tests and the benchmark ----

# A Qwen3-30B-A3B scaled down to about 8B parameters (benchmarks/cpu_forward.py --moe8b): its attention (32 query heads
# of 128, 4 KV heads) and experts (moe_ffn 768, top 8) on hidden 2048, 24 layers of 64 experts, Qwen3's vocabulary.
QWEN3_MOE_8B = dict(layers=24, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=64, used=8, moe_ffn=768,
                    ffn=6144, vocab=151936)
# d of random blocks whose values have a std of ~0.02 (measured with gguf.quants.dequantize)
BLOCK_SCALE = {"Q4_0": 0.006, "Q8_0": 0.0004, "Q4_K": 1e-4, "Q6_K": 2.5e-5}


def moe_param_count(s: dict) -> int:
    D, qd, kd = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    attn = 2 * D * qd + 2 * D * kd
    return 2 * s["vocab"] * D + s["layers"] * (attn + s["experts"] * (D + 3 * s["moe_ffn"] * D))


def write_random_moe_gguf(path: str, shapes: dict, types: dict | None = None, seed: int = 0, arch: str = "qwen3moe",
                          meta: dict | None = None) -> str:
    """A 'qwen3moe' (or, arch 'llama', Mixtral-style) GGUF with random weights, written tensor by tensor (the writer
    streams; a large file is never in memory), loadable by llama.cpp (an SPM-style vocabulary of byte tokens and
    placeholders). types: the type of "attn" (q, k, v, o), "experts" (gate, up, down stacks), "embd" and "output"
    matrices (default Q4_K; F32 allowed), each a rolled tile of one pool of random blocks of std ~0.02; the router
    (ffn_gate_inp) and the norms F32 (norms 1 + 0.1 N(0, 1), the router N(0, 0.02)), as llama.cpp keeps them.
    meta: more `{arch}.*` keys (an int as u32, a float as f32)."""
    from gguf_writer import F32, GGML, I32, STRING, GGUFFile, Lazy, random_blocks

    s = shapes
    types = {"attn": "Q4_K", "experts": "Q4_K", "embd": "Q4_K", "output": "Q4_K", **(types or {})}
    D, L, E, Fe, V, hd = s["hidden"], s["layers"], s["experts"], s["moe_ffn"], s["vocab"], s["head_dim"]
    H, Hkv = s["heads"], s["kv_heads"]
    rng = np.random.default_rng(seed)
    pools = {}

    def pool(t):
        if t not in pools:
            pools[t] = np.frombuffer(random_blocks(rng, t, 1 << 16, scale=BLOCK_SCALE[t]), np.uint8).reshape(-1, GGML[t][2])
        return pools[t]

    g = GGUFFile()
    g.str("general.architecture", arch)
    g.str("general.name", "random-moe")
    for k, v in {"block_count": L, "context_length": 32768, "embedding_length": D, "feed_forward_length": s["ffn"],
                 "attention.head_count": H, "attention.head_count_kv": Hkv, "attention.key_length": hd,
                 "attention.value_length": hd, "rope.dimension_count": hd, "vocab_size": V, "expert_count": E,
                 "expert_used_count": s["used"], "expert_feed_forward_length": Fe}.items():
        g.u32(f"{arch}.{k}", v)
    for k, v in (meta or {}).items():
        (g.f32 if isinstance(v, float) else g.u32)(f"{arch}.{k}", v)
    g.f32(f"{arch}.rope.freq_base", 1e6)
    g.f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"t{i}" for i in range(V - 259)]
    g.str("tokenizer.ggml.model", "llama")
    g.arr("tokenizer.ggml.tokens", STRING, tokens)
    g.arr("tokenizer.ggml.scores", F32, [0.0] * V)
    g.arr("tokenizer.ggml.token_type", I32, [2, 3, 3] + [6] * 256 + [1] * (V - 259))
    g.u32("tokenizer.ggml.bos_token_id", 1)
    g.u32("tokenizer.ggml.eos_token_id", 2)

    def matrix(name, shape, t):  # shape in numpy order: [rows, cols] or [E, rows, cols]
        ne = list(reversed(shape))
        n = int(np.prod(shape))
        if t == "F32":
            g.tensor(name, ne, GGML["F32"][0], (rng.standard_normal(n) * 0.02).astype(np.float32).tobytes())
            return
        p, be, bb = pool(t), GGML[t][1], GGML[t][2]
        off = int(rng.integers(0, len(p)))

        def make(nb=n // be, off=off, p=p):
            return np.tile(np.roll(p, off, axis=0), (-(-nb // len(p)), 1))[:nb].tobytes()
        g.tensor(name, ne, GGML[t][0], Lazy(n // be * bb, make))

    def vector(name, n, base=1.0):
        g.tensor(name, [n], GGML["F32"][0], (base + 0.1 * rng.standard_normal(n)).astype(np.float32).tobytes())

    matrix("token_embd.weight", [V, D], types["embd"])
    vector("output_norm.weight", D)
    matrix("output.weight", [V, D], types["output"])
    for l in range(L):
        p = f"blk.{l}."
        vector(p + "attn_norm.weight", D)
        matrix(p + "attn_q.weight", [H * hd, D], types["attn"])
        matrix(p + "attn_k.weight", [Hkv * hd, D], types["attn"])
        matrix(p + "attn_v.weight", [Hkv * hd, D], types["attn"])
        matrix(p + "attn_output.weight", [D, H * hd], types["attn"])
        if arch == "qwen3moe":
            vector(p + "attn_q_norm.weight", hd)
            vector(p + "attn_k_norm.weight", hd)
        vector(p + "ffn_norm.weight", D)
        matrix(p + "ffn_gate_inp.weight", [E, D], "F32")
        matrix(p + "ffn_gate_exps.weight", [E, Fe, D], types["experts"])
        matrix(p + "ffn_up_exps.weight", [E, Fe, D], types["experts"])
        matrix(p + "ffn_down_exps.weight", [E, D, Fe], types["experts"])
    g.write(path)
    return path
