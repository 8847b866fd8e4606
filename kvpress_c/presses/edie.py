from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ALLOCATIONS, SCORERS, ScorerPress


@dataclass
class EDIEPress(ScorerPress):
    """EDIE (error-driven eviction; EDIE-TADA-error-driven-eviction.txt): for window query j and past
    key i, U = a / (1 + alpha - a) * (|v_i|_1 + |o_j|_1), weighted by c_j = the largest attention of j
    on the mid-range keys (w < i <= n - 2w), summed over window queries and over each GQA group,
    mean-pooled (kernel 7). The window (32) is protected and counts toward the budget."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    window_size: int = 32
    kernel_size: int = 7
    alpha: float = 0.1

    scorer = "edie"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be a positive integer, got {self.window_size!r}")
        if isinstance(self.kernel_size, bool) or not isinstance(self.kernel_size, int) or self.kernel_size < 1 \
                or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if self.budget is not None and self.budget < self.window_size:
            raise ValueError(f"budget ({self.budget}) must be at least window_size ({self.window_size})")

    def c_config(self) -> dict:
        return {"scorer": SCORERS["edie"], "allocation": ALLOCATIONS["uniform"],
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": self.window_size, "kernel": self.kernel_size, "edie_alpha": float(self.alpha)}
