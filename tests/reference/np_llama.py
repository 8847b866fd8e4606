"""A float64 NumPy Llama/Mistral/Qwen2/Qwen3 forward pass for Hugging Face folders: the reference that the
C engine's schedules (TAKE chunked prefill, Judge Q soft tokens) are tested against.

Ragged per-head cache: cache[l][h] = dict(k=[len, d], v=[len, d], pos=[len]). A layer hook may
replace cache[l] after the layer's attention (that is where presses act).
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np


class NpLlama:
    def __init__(self, path: str):
        from safetensors.numpy import load_file
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        self.c = c
        self.L = c["num_hidden_layers"]
        self.D = c["hidden_size"]
        self.H = c["num_attention_heads"]
        self.Hkv = c.get("num_key_value_heads") or self.H
        self.d = c.get("head_dim") or self.D // self.H
        self.eps = c.get("rms_norm_eps", 1e-6)
        w = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            w.update({k: v.astype(np.float64) for k, v in load_file(f).items()})
        self.w = w
        self.tied = "lm_head.weight" not in w
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        inv = theta ** (-np.arange(0, self.d, 2, dtype=np.float64) / self.d)
        rs = c.get("rope_scaling") or c.get("rope_parameters")
        if rs and rs.get("rope_type", rs.get("type")) == "llama3":
            factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            old = rs["original_max_position_embeddings"]
            wl = 2 * np.pi / inv
            smooth = (old / wl - lo) / (hi - lo)
            scaled = np.where(wl > old / lo, inv / factor, inv)
            mid = (wl <= old / lo) & (wl >= old / hi)
            inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        self.inv_freq = inv

    def W(self, name):
        return self.w[name]

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """x [n, heads, d], half-split pairing (Hugging Face)."""
        ang = np.asarray(pos, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        h = self.d // 2
        a, b = x[..., :h], x[..., h:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def empty_cache(self):
        return [[dict(k=np.zeros((0, self.d)), v=np.zeros((0, self.d)), pos=np.zeros(0, dtype=np.int64))
                 for _ in range(self.Hkv)] for _ in range(self.L)]

    def embed(self, ids):
        return self.W("model.embed_tokens.weight")[np.asarray(ids)]

    def forward(self, x, pos, cache, hook=None, lora=None):
        """x [n, D] input embeddings at positions pos; appends to cache; returns final hidden [n, D].
        hook(l, q [n,H,d], attn [n,H,d], o [n,D], resid [n,D], past [Hkv], cache) after attention (o may be
        changed in place: the residual adds it afterwards). lora: {weight name: delta [out, in]} added to those
        weights for this pass (a LoRA merged by hand)."""
        W = self.W if not lora else (lambda name: self.w[name] + lora[name] if name in lora else self.w[name])
        n = x.shape[0]
        g = self.H // self.Hkv
        for l in range(self.L):
            p = f"model.layers.{l}."
            resid = x
            xn = self.rmsnorm(x, W(p + "input_layernorm.weight"))
            q = xn @ W(p + "self_attn.q_proj.weight").T
            k = xn @ W(p + "self_attn.k_proj.weight").T
            v = xn @ W(p + "self_attn.v_proj.weight").T
            if p + "self_attn.q_proj.bias" in self.w:
                q = q + W(p + "self_attn.q_proj.bias")
                k = k + W(p + "self_attn.k_proj.bias")
                v = v + W(p + "self_attn.v_proj.bias")
            q, k = q.reshape(n, self.H, self.d), k.reshape(n, self.Hkv, self.d)
            if p + "self_attn.q_norm.weight" in self.w:  # qwen3: each head normalised before RoPE
                q = self.rmsnorm(q, W(p + "self_attn.q_norm.weight"))
                k = self.rmsnorm(k, W(p + "self_attn.k_norm.weight"))
            q, k = self.rope(q, pos), self.rope(k, pos)
            v = v.reshape(n, self.Hkv, self.d)
            past = np.array([cache[l][h]["k"].shape[0] for h in range(self.Hkv)])
            for h in range(self.Hkv):
                ch = cache[l][h]
                ch["k"] = np.concatenate([ch["k"], k[:, h]])
                ch["v"] = np.concatenate([ch["v"], v[:, h]])
                ch["pos"] = np.concatenate([ch["pos"], np.asarray(pos, dtype=np.int64)])
            attn = np.zeros((n, self.H, self.d))
            for hq in range(self.H):
                h = hq // g
                K, V = cache[l][h]["k"], cache[l][h]["v"]
                s = q[:, hq] @ K.T / np.sqrt(self.d)
                vis = np.arange(K.shape[0])[None, :] < (past[h] + np.arange(n) + 1)[:, None]
                s = np.where(vis, s, -np.inf)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                attn[:, hq] = (s / s.sum(axis=1, keepdims=True)) @ V
            o = attn.reshape(n, -1) @ W(p + "self_attn.o_proj.weight").T
            if hook is not None:
                hook(l, q, attn, o, resid, past, cache)
            x = x + o
            xn = self.rmsnorm(x, W(p + "post_attention_layernorm.weight"))
            gate = xn @ W(p + "mlp.gate_proj.weight").T
            up = xn @ W(p + "mlp.up_proj.weight").T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ W(p + "mlp.down_proj.weight").T
        return x

    def logits(self, hidden):
        head = self.W("model.embed_tokens.weight") if self.tied else self.W("lm_head.weight")
        return self.rmsnorm(hidden, self.W("model.norm.weight")) @ head.T
