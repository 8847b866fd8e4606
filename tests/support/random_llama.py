"""Random-weight Llama folders written with NumPy alone (no torch): small float32 models for tests
that need a model of a given shape (head_dim 64 / 128 for the CUDA kernels), and sharded bf16
Llama-3.1-8B-shaped models for the GPU benchmarks and large-model tests."""
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


# Llama-3.1-8B: the shapes of the CUDA backend's benchmarks and its large-model tests
LLAMA31_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, head_dim=128)


def llama31_8b_dir() -> str:
    """Where the GPU tests and benchmarks keep the 8B-shaped folder: $KVC_LLAMA8B_DIR, else
    <tmp>/kvpress_c_llama8b_random_bf16 (written once per machine, shared by both)."""
    import tempfile
    return os.environ.get("KVC_LLAMA8B_DIR") or os.path.join(tempfile.gettempdir(), "kvpress_c_llama8b_random_bf16")


def write_llama31_bf16(path: str, shapes: dict = LLAMA31_8B, seed: int = 0, shard_bytes: int = 4 << 30) -> str:
    """A Llama-3.1 folder (llama3 RoPE scaling, theta 500000, untied head) with random bf16 weights:
    config.json + model-0000i-of-0000n.safetensors shards of ~`shard_bytes`, written tensor by tensor (16 GB
    for the 8B shapes, without holding it in memory). The weights are rolled tiles of one pool of 2^24
    N(0, 0.02) draws: fresh numbers for 8B parameters would take minutes and change no speed or memory
    figure. An existing folder (config.json is written last) is reused as it is."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    s = shapes
    D, F, hd, V = s["hidden"], s["ffn"], s["head_dim"], s["vocab"]
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    pool = pool.astype(np.uint16)
    ones = np.full(1 << 16, 0x3F80, np.uint16)  # bf16 1.0 for the norms

    def tensor(shape):
        n = int(np.prod(shape))
        src = ones if len(shape) == 1 else pool
        reps = -(-n // len(src))
        off = int(rng.integers(0, len(src)))
        return np.tile(np.roll(src, off), reps)[:n]

    names = [("model.embed_tokens.weight", (V, D))]
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        names += [(p + "input_layernorm.weight", (D,)), (p + "post_attention_layernorm.weight", (D,)),
                  (p + "self_attn.q_proj.weight", (s["heads"] * hd, D)),
                  (p + "self_attn.k_proj.weight", (s["kv_heads"] * hd, D)),
                  (p + "self_attn.v_proj.weight", (s["kv_heads"] * hd, D)),
                  (p + "self_attn.o_proj.weight", (D, s["heads"] * hd)),
                  (p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D)),
                  (p + "mlp.down_proj.weight", (D, F))]
    names += [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]
    # one shard per ~shard_bytes, written tensor by tensor (safetensors: u64 header size, JSON header, data)
    shards, cur, size = [], [], 0
    for name, shape in names:
        b = 2 * int(np.prod(shape))
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += b
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape in shard:
            b = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + b]}
            off += b
            weight_map[name] = fname
        hj = json.dumps(header).encode()
        hj += b" " * (-len(hj) % 8)
        with open(os.path.join(path, fname + ".tmp"), "wb") as f:
            f.write(len(hj).to_bytes(8, "little"))
            f.write(hj)
            for name, shape in shard:
                f.write(tensor(shape).tobytes())
        os.replace(os.path.join(path, fname + ".tmp"), os.path.join(path, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": s["layers"],
           "hidden_size": D, "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
           "head_dim": hd, "intermediate_size": F, "vocab_size": V, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "bos_token_id": min(128000, V - 2), "eos_token_id": min(128001, V - 1)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_llama31_gguf(path: str, type_name: str = "Q4_0", shapes: dict = LLAMA31_8B, seed: int = 0) -> str:
    """A Llama-3.1-shaped GGUF (theta 500000, untied head, no RoPE scaling) with random weights in a
    32-value block type (Q4_0 or Q8_0: 4.5 or 8.5 GB for the 8B shapes), written tensor by tensor (the
    writer streams: the file is never in memory) so that llama.cpp loads it too (an SPM-style vocabulary
    of byte tokens and placeholders). Like write_llama31_bf16, matrices are rolled tiles of one pool of
    random blocks (2^20 blocks; weights of std ~0.02); norms are 1."""
    from gguf_writer import GGML, GGUFFile, Lazy, random_blocks, F32, STRING, I32
    s = shapes
    D, F, hd, V, L = s["hidden"], s["ffn"], s["head_dim"], s["vocab"], s["layers"]
    H, Hkv = s["heads"], s["kv_heads"]
    tid, be, bb = GGML[type_name]
    rng = np.random.default_rng(seed)
    scale = {"Q4_0": 0.006, "Q8_0": 0.0004}[type_name]  # d of the blocks: values of std ~0.02
    pool = np.frombuffer(random_blocks(rng, type_name, 1 << 20, scale=scale), np.uint8).reshape(-1, bb)
    g = GGUFFile()
    g.str("general.architecture", "llama")
    g.str("general.name", "random-llama31-8b-shaped")
    for k, v in {"block_count": L, "context_length": 131072, "embedding_length": D, "feed_forward_length": F,
                 "attention.head_count": H, "attention.head_count_kv": Hkv, "rope.dimension_count": hd,
                 "vocab_size": V}.items():
        g.u32(f"llama.{k}", v)
    g.f32("llama.rope.freq_base", 500000.0)
    g.f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    # vocabulary: <unk> <s> </s>, the 256 byte tokens, placeholders (types: 2 unknown, 3 control, 6 byte, 1 normal)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"t{i}" for i in range(V - 259)]
    g.str("tokenizer.ggml.model", "llama")
    g.arr("tokenizer.ggml.tokens", STRING, tokens)
    g.arr("tokenizer.ggml.scores", F32, [0.0] * V)
    g.arr("tokenizer.ggml.token_type", I32, [2, 3, 3] + [6] * 256 + [1] * (V - 259))
    g.u32("tokenizer.ggml.bos_token_id", 1)
    g.u32("tokenizer.ggml.eos_token_id", 2)

    def matrix(name, rows, cols):
        n = rows * cols // be
        off = int(rng.integers(0, len(pool)))

        def make():
            reps = -(-n // len(pool))
            return np.tile(np.roll(pool, off, axis=0), (reps, 1))[:n].tobytes()
        g.tensor(name, [cols, rows], tid, Lazy(n * bb, make))

    def norm(name):
        g.tensor(name, [D], GGML["F32"][0], np.ones(D, np.float32).tobytes())

    matrix("token_embd.weight", V, D)
    norm("output_norm.weight")
    matrix("output.weight", V, D)
    for l in range(L):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", H * hd, D)
        matrix(p + "attn_k.weight", Hkv * hd, D)
        matrix(p + "attn_v.weight", Hkv * hd, D)
        matrix(p + "attn_output.weight", D, H * hd)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", F, D)
        matrix(p + "ffn_up.weight", F, D)
        matrix(p + "ffn_down.weight", D, F)
    g.write(path)
    return path
