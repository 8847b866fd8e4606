"""kvpress's own presses inside the engine: `from_kvpress(press)` runs a kvpress ScorerPress's score(module,
hidden_states, keys, values, attentions, kwargs) as a Python press (python_press.py), on torch tensors over the
engine's arrays, with a `module` stand-in that carries what kvpress's presses read of an attention layer:

- `config` (num_attention_heads, num_key_value_heads, head_dim), `layer_idx`, `head_dim`;
- `q_proj` and `hidden_states`: the engine gives the call's queries after RoPE, not the layer's input, so the
  stand-in's hidden states are the queries with RoPE undone ([1, n, H d]) and its q_proj is the identity:
  kvpress's get_prerope_query_states then gives the pre-RoPE queries it would have computed (q-norm included);
- `rotary_emb(x, position_ids)` and kwargs["position_embeddings"]: RoPE's cos, sin of the call's frequencies (as the
  forward turned its rows: LongRoPE's long factors past the original context) times the attention factor, in
  Hugging Face's half-split layout. (kvpress's ExpectedAttention asks for positions after the call: a call before
  the original context whose n_future positions pass it gets the call's short factors here, the long ones there.) Keys and queries of a GGUF llama (adjacent pairs) are handed over with their
  channels permuted into that layout: dot products, and so every score, are unchanged.

Anything else a press reads of the module, its config or kwargs is refused with an AttributeError naming it.
Heads must hold the same rows (kvpress's tensors are [1, Hkv, n, d]), so it runs in a prefill, not after Ada-KV.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import ScorerPress


class _Strict:
    """Attributes given at construction; any other is refused by name."""

    def __init__(self, what: str, press_name: str, **attrs):
        self.__dict__.update(attrs)
        self.__dict__["_what"], self.__dict__["_press"] = what, press_name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"from_kvpress: {self._press} reads {self._what}.{name}, which the stand-in does not "
                             f"carry (it has {', '.join(k for k in self.__dict__ if not k.startswith('_'))})")


class _Kwargs(dict):
    def __init__(self, press_name, **kw):
        super().__init__(**kw)
        self._press = press_name

    def __missing__(self, key):
        raise AttributeError(f"from_kvpress: {self._press} reads kwargs[{key!r}], which the stand-in does not carry "
                             f"(it has {', '.join(self)})")


def _rotate_half(x):
    import torch
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@dataclass
class KvpressScorerPress(ScorerPress):
    """A kvpress ScorerPress run by the engine (from_kvpress); compression_ratio is the kvpress press's."""
    press: Any = None

    reads = ("all_queries", "values")

    def __post_init__(self):
        from kvpress.presses.scorer_press import ScorerPress as KvpressScorer
        if not isinstance(self.press, KvpressScorer):
            raise ValueError(f"from_kvpress takes a kvpress ScorerPress (it runs its score()), not {type(self.press).__name__}")
        self.compression_ratio = float(self.press.compression_ratio)
        super().__post_init__()

    def score(self, layer):
        import torch
        name = type(self.press).__name__
        lens = layer.lengths
        if (lens != lens[0]).any():
            raise ValueError(f"from_kvpress: {name} needs every head of layer {layer.index} to hold the same rows "
                             f"(kvpress's tensors are [1, Hkv, n, d]); they hold {lens.tolist()}")
        n, d, H = int(lens[0]), layer.head_dim, layer.n_heads
        perm = np.r_[0:d:2, 1:d:2] if layer.rope_pairing == "adjacent" else np.arange(d)
        with warnings.catch_warnings():  # the views are read-only; the press only reads them
            warnings.simplefilter("ignore", UserWarning)
            keys = torch.from_numpy(np.ascontiguousarray(layer.keys[:, :n][..., perm]))[None]
            values = torch.from_numpy(layer.values[:, :n])[None]
            q = torch.from_numpy(np.ascontiguousarray(layer.queries[..., perm]))      # [H, n_call, d] after RoPE
        inv_freq = torch.from_numpy(layer.rope_freqs.astype(np.float32))
        # transformers' attention_scaling (LongRoPE's factor) on the turned pairs, in its cos and sin
        scale = torch.where(inv_freq != 0, float(layer.rope_attn_factor), 1.0).repeat(2)

        def rotary_emb(x, position_ids):
            f = position_ids[..., None].to(torch.float32) * inv_freq                 # [1, len, d/2]
            emb = torch.cat((f, f), dim=-1)
            return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

        cos, sin = rotary_emb(q, torch.from_numpy(layer.positions)[None])
        pre = (q * cos - _rotate_half(q) * sin) / scale**2                          # RoPE undone
        hidden = pre.transpose(0, 1).reshape(1, q.shape[1], H * d)
        config = _Strict("module.config", name, num_attention_heads=H, num_key_value_heads=layer.n_kv_heads,
                         head_dim=d)
        module = _Strict("module", name, config=config, layer_idx=layer.index, head_dim=d,
                         q_proj=lambda h: h, rotary_emb=rotary_emb)
        kwargs = _Kwargs(name, position_embeddings=(cos, sin))
        with torch.no_grad():
            s = self.press.score(module, hidden, keys, values, None, kwargs)
        return s[0].double().numpy()


def from_kvpress(press) -> KvpressScorerPress:
    """A kvpress ScorerPress (KnormPress, SnapKVPress, ExpectedAttentionPress, ...) run inside the engine with its
    own score(); the result is a kvpress_c press (AdaKVPress(from_kvpress(p)), ChunkKVPress, ... take it)."""
    return KvpressScorerPress(press=press)
