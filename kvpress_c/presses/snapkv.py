from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ALLOCATIONS, SCORERS, ScorerPress


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

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be a positive integer, got {self.window_size!r}")
        if isinstance(self.kernel_size, bool) or not isinstance(self.kernel_size, int) or self.kernel_size < 1 \
                or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")
        if self.gqa_reduce not in ("mean", "max"):
            raise ValueError(f"gqa_reduce must be 'mean' or 'max', got {self.gqa_reduce!r}")
        if self.budget is not None and self.budget < self.window_size:
            raise ValueError(f"budget ({self.budget}) must be at least window_size ({self.window_size}): "
                             "the window is kept inside the budget")

    def c_config(self) -> dict:
        return {"scorer": SCORERS["snapkv"], "allocation": ALLOCATIONS["uniform"],
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": self.window_size, "kernel": self.kernel_size, "pool_max": int(self.pooling == "max"),
                "gqa_max": int(self.gqa_reduce == "max"), "pool_then_reduce": int(bool(self.pool_then_reduce))}
