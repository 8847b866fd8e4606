from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int, check_number


@dataclass
class DropKVPress(ScorerPress):
    """DropKV ("KV cache eviction via Decoupled Residual-Output Perturbation", openreview MqfNzH3TVH;
    kvpress pull request #285, DropKVPress).

    Evicting one row renormalises each window query's softmax over the rows left, moving its attention
    output o_j by p_jr / (1 - p_jr) (o_j - v_r). Each row is scored by that move squared, summed over the
    last `window_size` queries, s_r = sum_j (p_jr / (1 - p_jr + epsilon))^2 ||v_r - o_j||^2, averaged over
    the KV head's query heads and average-pooled over `kernel_size` rows; the window is always kept, and
    every head keeps at least `window_size` rows (kvpress's rule). Defaults are the pull request's
    (window 32, kernel 7, epsilon 1e-6).
    """
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    window_size: int = 32
    kernel_size: int = 7
    epsilon: float = 1e-6

    scorer = "dropkv"

    def check_types(self) -> None:
        super().check_types()
        check_int("window_size", self.window_size, 1)
        check_int("kernel_size", self.kernel_size, 1)
        check_number("epsilon", self.epsilon)

    def c_config(self) -> dict:
        return {"scorer": "dropkv", "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": self.window_size, "kernel": self.kernel_size, "epsilon": float(self.epsilon)}
