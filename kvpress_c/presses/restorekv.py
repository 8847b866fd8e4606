from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ._tensor_files import read_tensors
from .kvzip import KVzipPress

RESTOREKV_URL = "https://huggingface.co/higokri (repositories RestoreKV-<model>, RestoreKV-<model>_plus for KVzip+)"
# PEFT's target module names, in the C core's kvc_lora_target order
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# adapters on these never touch the restore rows' K/V (the rows enter as embeddings; the LM head is not run)
UNUSED = ("embed_tokens", "lm_head")
LORA_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class RestoreKVPress(KVzipPress):
    """RestoreKV (arXiv 2608.01247): learned restoration on top of KVzip (kvpress's RestoreKVPress).

    KVzip scores the context (its reconstruction on the full cache, `kvzip_plus_normalization` for KVzip+); then n
    restore embeddings (8 in the published files) run once through the model with a LoRA adapter active, over the
    full cache, at the positions after the context; their K/V are appended to every layer and never evicted. The
    context is then evicted by KVzip at the budget-matched ratio min(1, compression_ratio + n / context length), so
    the cache holds the kept context rows plus the n restore rows, and the question continues after them (positions
    context length + n on: kvpress's pipeline sets the context length to the cache's length, restore rows included).
    The adapter is active for that one pass only; the model is never changed. The pass runs on the host in fp32 with
    the adapter added to each projection (csrc/press/restorekv.c) and its K/V go into the cache through the backend,
    so it works on every device (a device model reads an fp32 copy of its file).

    The files come from a local folder (`adapter_path`), the one you downloaded from {url} (kvpress downloads
    `higokri/RestoreKV-<model>`, or `..._plus` with `kvzip_plus_normalization`: point at the matching one):
    restore_embeddings.safetensors (tensor "restore_embeddings" [n, hidden]), and PEFT's adapter_config.json
    (r, lora_alpha, use_rslora, target_modules) and adapter_model.safetensors (`...layers.{{i}}.self_attn.q_proj.
    lora_A.weight` / `lora_B.weight` and the like on q/k/v/o/gate/up/down_proj). Nothing is downloaded. DoRA, LoRA
    biases, rank/alpha patterns and modules_to_save are refused (NotImplementedError).
    """
    compression_ratio: float = 0.0
    layerwise: bool = False
    n_sink: int = 4
    kvzip_plus_normalization: bool = False
    chunk_size: int = 2048
    adapter_path: Optional[str] = None
    files: tuple = field(init=False, default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self.files = load_restorekv(self.adapter_path)

    @property
    def num_restore_tokens(self) -> int:
        return len(self.files[0])

    def restore_inputs(self, model) -> tuple[np.ndarray, list]:
        """(restore embeddings float32 [n, hidden], LoRA entries for Session.append_embeddings) checked against the
        model's shapes, q/k rows permuted to the model's own order (GGUF llama weights pair RoPE dimensions
        adjacently)."""
        emb, adapters, cfg_scale = self.files
        c = model.config
        if emb.shape[1] != c["hidden"]:
            raise ValueError(f"{self.adapter_path}: restore_embeddings are {emb.shape[0]} x {emb.shape[1]}; this model's "
                             f"hidden size is {c['hidden']} (files for another model?)")
        shapes = lora_shapes(c)
        entries = []
        for (layer, name), (a, b, scale) in sorted(adapters.items()):
            if layer >= c["n_layers"]:
                raise ValueError(f"{self.adapter_path}: the adapter has layer {layer}; this model has {c['n_layers']} layers")
            want_in, want_out = shapes[name]
            if a.shape[1] != want_in or b.shape[0] != want_out:
                raise ValueError(f"{self.adapter_path}: layer {layer} {name}: lora_A is {a.shape[0]} x {a.shape[1]}, lora_B "
                                 f"{b.shape[0]} x {b.shape[1]}; this model's {name} maps {want_in} -> {want_out}")
            if name in ("q_proj", "k_proj") and c.get("rope_pairing") == "adjacent":
                b = b[hf_to_adjacent(b.shape[0], c["head_dim"])]
            entries.append((layer, TARGETS.index(name), a, np.ascontiguousarray(b), scale))
        return emb, entries

    def turn_refusal(self) -> Optional[str]:
        return ("RestoreKVPress places its learned restore rows between a compressed context and the question that "
                "follows; a conversation's turn ends with its question, and restore rows would take positions no text "
                "of the conversation has (a later turn's reconstruction could not read them): compress the context "
                "(Pipeline.compress) and converse from the file (Conversation.load), or converse with KVzipPress")

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        if self.compression_ratio > 0:
            scores = self.scores(session, ids)  # KVzip's, on the context alone
            emb, lora = self.restore_inputs(session.model)
            session.append_embeddings(emb, lora=lora)
            n = len(ids)
            ratio = min(1.0, float(self.compression_ratio) + len(emb) / n)  # budget-matched
            session.kvzip_evict(scores, ratio, layerwise=self.layerwise, n_sink=self.n_sink)


RestoreKVPress.__doc__ = RestoreKVPress.__doc__.format(url=RESTOREKV_URL)


def lora_shapes(c: dict) -> dict:
    D, F = c["hidden"], c["ffn"]
    qd, kd = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"]
    return {"q_proj": (D, qd), "k_proj": (D, kd), "v_proj": (D, kd), "o_proj": (qd, D), "gate_proj": (D, F),
            "up_proj": (D, F), "down_proj": (F, D)}


def hf_to_adjacent(rows: int, d: int) -> np.ndarray:
    """Row order of a q/k projection in a GGUF llama (adjacent RoPE pairs) from Hugging Face's (half-split):
    row h d + 2 i + t takes HF row h d + t d / 2 + i."""
    i = np.arange(rows)
    h, r = i // d, i % d
    return h * d + (r % 2) * (d // 2) + r // 2


def load_restorekv(path):
    """(restore embeddings float32 [n, D], {(layer, target): (A [r, in], B [out, r], scale)}, scale) from a folder."""
    if path is None:
        raise ValueError(f"RestoreKVPress needs its restore embeddings and LoRA adapter from a local folder: download "
                         f"restore_embeddings.safetensors, adapter_config.json and adapter_model.safetensors from "
                         f"{RESTOREKV_URL} and pass adapter_path='that/folder' (kvpress_c never downloads)")
    path = os.fspath(path)
    files = {n: os.path.join(path, n) for n in ("restore_embeddings.safetensors", "adapter_config.json",
                                                 "adapter_model.safetensors")}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"RestoreKV files missing: {', '.join(missing)} (get them from {RESTOREKV_URL})")
    emb = read_tensors(files["restore_embeddings.safetensors"])
    if "restore_embeddings" not in emb:
        raise ValueError(f"{files['restore_embeddings.safetensors']} has no tensor 'restore_embeddings' "
                         f"(it holds {', '.join(sorted(emb)) or 'nothing'})")
    emb = emb["restore_embeddings"]
    if emb.ndim != 2 or emb.shape[0] < 1 or not np.isfinite(emb).all():
        raise ValueError(f"{files['restore_embeddings.safetensors']}: restore_embeddings must be a finite [n, hidden] "
                         f"matrix, got shape {emb.shape}")
    with open(files["adapter_config.json"]) as f:
        cfg = json.load(f)
    scale = lora_scale(cfg, files["adapter_config.json"])
    tensors = read_tensors(files["adapter_model.safetensors"])
    pairs: dict = {}
    for key, t in tensors.items():
        m = LORA_KEY.search(key)
        if m is None:
            if any(u in key for u in UNUSED):
                continue
            raise ValueError(f"{files['adapter_model.safetensors']}: tensor {key!r} is not a LoRA A/B weight of a layer's "
                             f"projection")
        layer, name, ab = int(m.group(1)), m.group(2), m.group(3)
        if name not in TARGETS:
            raise NotImplementedError(f"{files['adapter_model.safetensors']}: LoRA on {name!r} (layer {layer}); kvpress_c "
                                      f"applies adapters on {', '.join(TARGETS)}")
        pairs.setdefault((layer, name), {})[ab] = t
    adapters = {}
    for (layer, name), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{files['adapter_model.safetensors']}: layer {layer} {name} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{files['adapter_model.safetensors']}: layer {layer} {name}: lora_A {a.shape} and lora_B "
                             f"{b.shape} do not make a rank-r pair")
        if a.shape[0] != cfg["r"]:
            raise ValueError(f"{files['adapter_model.safetensors']}: layer {layer} {name} has rank {a.shape[0]}, "
                             f"adapter_config.json says r = {cfg['r']}")
        adapters[(layer, name)] = (np.ascontiguousarray(a), np.ascontiguousarray(b), scale)
    if not adapters:
        raise ValueError(f"{files['adapter_model.safetensors']} holds no LoRA weights")
    return emb, adapters, scale


def lora_scale(cfg: dict, where: str) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; the LoRA variants it does not run
    refused."""
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise NotImplementedError(f"{where}: peft_type {cfg.get('peft_type')!r}; RestoreKV's adapters are LoRA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("use_dora", lambda v: not v), ("lora_bias", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
                    ("bias", lambda v: v in (None, "none")), ("rank_pattern", lambda v: not v),
                    ("alpha_pattern", lambda v: not v), ("modules_to_save", lambda v: not v)):
        if not ok(cfg.get(key)):
            raise NotImplementedError(f"{where}: {key} = {cfg[key]!r} is not supported (plain LoRA on the projections "
                                      f"with one r and lora_alpha)")
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
