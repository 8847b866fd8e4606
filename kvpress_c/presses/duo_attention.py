from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import BasePress, check_number

PATTERNS_URL = "https://github.com/mit-han-lab/duo-attention/tree/main/attn_patterns"


@dataclass
class DuoAttentionPress(BasePress):
    """DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
    Streaming Heads"): the `head_compression_ratio` fraction of KV heads with the lowest pattern scores become
    streaming heads, which keep only `sink_size` first and `recent_size` last tokens; retrieval heads keep
    everything. kvpress masks the streaming heads' middle keys; here they are evicted (ragged cache).

    The patterns come from a local folder (`pattern_path`) holding the DuoAttention repository's files for
    the model: `config.json` (with `sink_size` and `recent_size`) and `full_attention_heads.tsv` (one row per
    layer, one column per KV head), e.g. from {url}/<model>/. Nothing is downloaded.
    """
    head_compression_ratio: float = 0.0
    pattern_path: Optional[str] = None
    sink_size: int = field(init=False, default=None)
    recent_size: int = field(init=False, default=None)
    head_scores: np.ndarray = field(init=False, default=None, repr=False)
    streaming_mask: np.ndarray = field(init=False, default=None, repr=False)

    def __post_init__(self):
        check_number("head_compression_ratio", self.head_compression_ratio)
        if not 0 <= self.head_compression_ratio <= 1:
            raise ValueError(f"head_compression_ratio must be in [0, 1], got {self.head_compression_ratio!r}")
        self.sink_size, self.recent_size, self.head_scores = load_attention_pattern(self.pattern_path)
        # the lowest-scoring heads stream (kvpress: argsort of the flattened scores)
        n_pruned = round(self.head_scores.size * self.head_compression_ratio)
        mask = np.zeros(self.head_scores.size, dtype=bool)
        mask[np.argsort(self.head_scores, axis=None, kind="stable")[:n_pruned]] = True
        self.streaming_mask = mask.reshape(self.head_scores.shape)

    @property
    def is_noop(self) -> bool:
        return not self.streaming_mask.any()

    def c_config(self) -> dict:
        return {"scorer": "streaming", "allocation": "uniform", "compression_ratio": 0.0,
                "budget": 0, "window": 0, "kernel": 1, "n_sink": int(self.sink_size)}

    def head_budgets(self) -> np.ndarray:
        """Rows each (layer, KV head) keeps: -1 (all) for retrieval heads, sink + recent for streaming ones."""
        return np.where(self.streaming_mask, self.sink_size + self.recent_size, -1).astype(np.int64)

    def before_prefill(self, session, n: int, config: dict) -> None:
        want = (config["n_layers"], config["n_kv_heads"])
        if self.head_scores.shape != want:
            raise ValueError(f"the attention patterns in {self.pattern_path} are for {self.head_scores.shape[0]} layers x "
                             f"{self.head_scores.shape[1]} KV heads; this model has {want[0]} x {want[1]}")
        session.set_press_array("head_budgets", self.head_budgets())


DuoAttentionPress.__doc__ = DuoAttentionPress.__doc__.format(url=PATTERNS_URL)


def load_attention_pattern(path) -> tuple[int, int, np.ndarray]:
    """(sink_size, recent_size, head scores clipped to [0, 1]) from a DuoAttention pattern folder."""
    if path is None:
        raise ValueError("DuoAttentionPress needs the model's attention patterns from a local folder: download "
                         f"config.json and full_attention_heads.tsv for your model from {PATTERNS_URL} and pass "
                         "pattern_path='that/folder' (kvpress_c never downloads)")
    files = {name: os.path.join(os.fspath(path), name) for name in ("config.json", "full_attention_heads.tsv")}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"DuoAttention pattern files missing: {', '.join(missing)} (get them for your model from "
                                f"{PATTERNS_URL})")
    with open(files["config.json"]) as f:
        cfg = json.load(f)
    for key in ("sink_size", "recent_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 0:
            raise ValueError(f"{files['config.json']}: {key} must be a non-negative integer, got {cfg.get(key)!r}")
    scores = np.loadtxt(files["full_attention_heads.tsv"], dtype=float, delimiter="\t", ndmin=2)
    if not np.isfinite(scores).all():
        raise ValueError(f"{files['full_attention_heads.tsv']}: scores must be finite numbers")
    return cfg["sink_size"], cfg["recent_size"], np.clip(scores, 0, 1)
