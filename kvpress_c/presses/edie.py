from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int, check_number


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

    def check_types(self) -> None:
        super().check_types()
        check_int("window_size", self.window_size)
        check_int("kernel_size", self.kernel_size)
        check_number("alpha", self.alpha)

    def c_config(self) -> dict:
        return {"scorer": "edie", "allocation": "uniform",
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": self.window_size, "kernel": self.kernel_size, "edie_alpha": float(self.alpha)}
