"""Tiny random-weight Hugging Face model folders written with transformers (torch on CPU), for the
loader and forward-parity tests: llama, mistral, qwen2 (q/k/v biases), qwen3 (per-head q/k norms) and
llama31 (Llama-3.1 RoPE scaling), in float32 / float16 / bfloat16, tied or not, one file or several shards;
any of mistral/qwen2/qwen3 with a sliding window (`window=`)."""
from __future__ import annotations

import json
import os

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "llama31")
DTYPES = ("float32", "float16", "bfloat16")

# GQA shapes: 4 query heads share 2 KV heads; head_dim 16 = hidden 64 / 4 heads.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# Llama-3.1 scaling with a small original context so that, with head_dim 16 and theta 1e4, the
# wavelengths 2*pi*1e4**(2i/16) = 6.3, 19.9, 62.8, 199, ... fall in all three regimes: kept
# (< 64/4 = 16), smoothly interpolated (16..64) and divided by the factor (> 64).
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _transformers_major() -> int:
    import transformers
    return int(transformers.__version__.split(".")[0])


def make_config(arch: str = "llama", tied: bool = False, vocab: int = 256, layers: int = 4, rope_theta: float = 10000.0,
                window: int | None = None, window_layers: int = 0, shape: dict | None = None):
    """The transformers config object for one of ARCHS. window: sliding-window attention (mistral: every
    layer; qwen2/qwen3: the layers from `window_layers` on). shape: TINY's entries to change (head_dim 64: KIVI's
    groups)."""
    import transformers

    common = dict(TINY, **(shape or {}), num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=tied)
    rope = {"rope_theta": rope_theta}
    if arch == "llama31":
        if _transformers_major() >= 5:  # v5 keeps every RoPE setting in rope_parameters
            rope = {"rope_parameters": dict(LLAMA3_SCALING, rope_theta=rope_theta)}
        else:
            rope = {"rope_theta": rope_theta, "rope_scaling": dict(LLAMA3_SCALING)}
    if arch in ("llama", "llama31"):
        return transformers.LlamaConfig(**common, **rope)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=window, **common, **rope)
    qwen_window = dict(use_sliding_window=True, sliding_window=window, max_window_layers=window_layers) if window else {}
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, **rope, **qwen_window)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, **rope, **qwen_window)
    raise ValueError(f"unknown arch {arch!r} (one of {ARCHS})")


def write_tiny_model(path: str, arch: str = "llama", dtype: str = "float32", tied: bool = False,
                     sharded: bool = False, seed: int = 0, vocab: int = 256, layers: int = 4,
                     with_tokenizer: bool = True, window: int | None = None, window_layers: int = 0,
                     shape: dict | None = None) -> str:
    """Write a small GQA model to the folder `path` (created if needed) and return `path`.

    Weights are random but deterministic in `seed`; matrices are drawn wider than transformers'
    default init (std 0.08) and norm weights around 1 (+-0.1), so logits are far from uniform and a
    loader that swaps two tensors of the same shape changes the output. `sharded` writes several
    model-0000x-of-0000y.safetensors files with model.safetensors.index.json."""
    import torch
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {DTYPES})")
    cfg = make_config(arch, tied=tied, vocab=vocab, layers=layers, window=window, window_layers=window_layers, shape=shape)
    cls = {"llama": transformers.LlamaForCausalLM, "llama31": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # qwen2's q/k/v biases: non-zero so that the bias path is exercised
                p.normal_(0, 0.5)
    model = model.to(getattr(torch, dtype))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB" if sharded else "10GB")
    if with_tokenizer:
        write_byte_tokenizer(path, vocab)
    return path


def write_byte_tokenizer(path: str, vocab: int = 256) -> None:
    """A byte-level BPE tokenizer without merges: ids 0/1/2 are <unk>/<s>/</s>, id 3 + b is byte b
    (for b < vocab - 3; higher bytes encode as <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    table = _bytes_to_unicode()
    chars = [table[b] for b in range(256)]
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<unk>", "<s>", "</s>"]
    vocab_map = {t: i for i, t in enumerate(specials)}
    for c in chars[: max(0, vocab - len(specials))]:
        vocab_map[c] = len(vocab_map)
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 2048,
                   "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                                    "{% if add_generation_prompt %}<s>assistant: {% endif %}"}, f, indent=1)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the standard byte-level mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---- the logit parity tests' references (tests/model): HF eager in fp32 ----

def rel_err(ours, ref):
    """max |ours - ref| / max |ref| over every value (ref float64)."""
    import numpy as np
    return float(np.max(np.abs(ours.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def hf_model(path):
    """A folder's model in fp32, eager attention: the mask (sliding window included) is the one transformers
    builds, not a kernel's own."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(hf, ids):
    """Every position's logits of one prompt, float64."""
    import torch
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def decode_err(hf, model, ids, n_prefill):
    """Relative logit error of a prefill of ids[:n_prefill] then one token at a time to the end, against HF's
    steps over its own cache: (ours, HF) as every position's logits."""
    import numpy as np
    import torch
    ref = []
    with torch.no_grad():
        out = hf(torch.tensor([ids[:n_prefill]]), use_cache=True)
        ref.append(out.logits[0].double().numpy())
        for t in ids[n_prefill:]:
            out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            ref.append(out.logits[0].double().numpy())
    s = model.new_session()
    ours = [s.forward(ids[:n_prefill], logits="all")] + [s.forward([t])[None] for t in ids[n_prefill:]]
    return rel_err(np.concatenate(ours), np.concatenate(ref))


def greedy_pair(hf, model, prompt, n_new=16):
    """Our greedy continuation, HF's, and whether HF's own rows had a near tie (1e-5 of the row's scale) on the
    way: the two are equal unless they had."""
    import numpy as np
    import torch
    ours = model.generate(prompt, max_new_tokens=n_new, stop_ids=[])
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = out[0, len(prompt):].tolist()
        rows = hf(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1:-1].double().numpy()
    near_tie = any(np.sort(r)[-1] - np.sort(r)[-2] < 1e-5 * np.abs(r).max() for r in rows)
    return ours, ref, near_tie


def gguf_writer_from_hf(out: str, arch: str, c):
    """A GGUFWriter for `arch` with the hyperparameters every llama.cpp converter writes from an HF config `c`
    (layers, context, widths, heads, RMSNorm eps, vocabulary size); the family's own keys are the caller's."""
    import gguf
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    return w
