from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_choice, check_int


@dataclass
class SnapKVPress(ScorerPress):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    The last `window_size` queries attend to every key; their softmax weights are averaged over the
    window, pooled over positions (`kernel_size`, `pooling` "avg" counting padding as torch does, or
    "max"), reduced over each GQA group (`gqa_reduce` "mean" or "max"; `pool_then_reduce` True is
    kvpress's order). The window is always kept and counts toward the budget. kvpress defaults
    (w=64, k=5, avg); the paper / Ada-KV code use w=32, k=7, max.
    """
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    window_size: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_reduce: str = "mean"
    pool_then_reduce: bool = True

    scorer = "snapkv"

    def check_types(self) -> None:
        super().check_types()
        check_int("window_size", self.window_size)
        check_int("kernel_size", self.kernel_size)
        check_choice("pooling", self.pooling, ("avg", "max"))
        check_choice("gqa_reduce", self.gqa_reduce, ("mean", "max"))

    def c_config(self) -> dict:
        return {"scorer": "snapkv", "allocation": "uniform",
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": self.window_size, "kernel": self.kernel_size, "pool_max": int(self.pooling == "max"),
                "gqa_max": int(self.gqa_reduce == "max"), "pool_then_reduce": int(bool(self.pool_then_reduce))}
